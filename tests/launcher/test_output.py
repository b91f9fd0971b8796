import errno
import io
import os
import re
import threading
import time
from pathlib import Path

import pytest

from launcher.output import LineSplitter, OutputOptions, OutputSink, rank_dir_name, use_colour


def split_all(chunks: list[bytes], max_line: int = 1024) -> list[bytes]:
    splitter = LineSplitter(max_line)
    lines = [line for chunk in chunks for line in splitter.feed(chunk)]
    return lines + splitter.flush()


def test_lines_across_chunks() -> None:
    assert split_all([b"hel", b"lo\nwor", b"ld\n"]) == [b"hello", b"world"]


def test_partial_line_flushed_at_end() -> None:
    assert split_all([b"a\npartial"]) == [b"a", b"partial"]


def test_carriage_returns_end_lines_and_crlf_is_one_terminator() -> None:
    assert split_all([b"10%\r20%\r", b"\ndone\r\n"]) == [b"10%", b"20%", b"done"]
    assert split_all([b"x\r", b"\r", b"\n"]) == [b"x", b""]


def test_a_bare_carriage_return_that_ends_nothing_shows_no_empty_line() -> None:
    """A progress bar writes '\\r' before each state: its first (after a line's end, or at
    the stream's start) is no line, while an empty CR LF line still is one."""
    bar = [b"\r 0%", b"\r 50%", b"\r100%", b"\n"]
    assert split_all(bar) == [b" 0%", b" 50%", b"100%"]
    assert split_all([b"epoch 1\n\r\r 0%\r", b"\r100%\n"]) == [b"epoch 1", b" 0%", b"100%"]
    assert split_all([b"a\r", b"\r", b"\nb\n"]) == split_all([b"a\r\r\nb\n"]) == [b"a", b"", b"b"]


@pytest.mark.parametrize(
    "chunks",
    [
        [b"10%\r20%\r", b"\ndone\r\n"],  # (a CR LF cut between two chunks)
        [b"x\r", b"\r", b"\n", b"\n"],
        [b"\xff\xfe binary\x00\n", b"abcdefghij", b"klm"],  # (cut lines, an unterminated tail)
        [b"a\r\n\r\n\n\rb"],
        [b"\r0%\r", b"\r50%\r\r", b"\n\r", b"\n"],
    ],
)
def test_the_pieces_put_back_together_are_the_stream(chunks: list[bytes]) -> None:
    splitter = LineSplitter(4)
    pieces = [piece for chunk in chunks for piece in splitter.split(chunk)] + splitter.tail()
    assert b"".join(text + end for text, end, _ in pieces) == b"".join(chunks)
    # the lines shown are those feed() returns
    again = LineSplitter(4)
    lines = [line for chunk in chunks for line in again.feed(chunk)] + again.flush()
    assert [text for text, _, shown in pieces if shown] == lines


@pytest.mark.parametrize(
    "chunks",
    [
        [b"one\ntwo\n", b"three\nfour", b" and more\nfive\n"],  # (a line across two reads)
        [b"a\nb\r\n", b"c\n\n", b"\rd\n"],  # (carriage returns: pieces, as before)
        [b"x\r", b"\ny\n"],  # (a CR LF cut between two chunks)
        [b"\xff\n\x00\n", b"abcdefghij\n", b"tail"],
    ],
)
def test_runs_of_whole_lines_and_pieces_put_back_together_are_the_stream(
    chunks: list[bytes],
) -> None:
    """split_run gives a chunk's whole lines as one run where it can, the rest as split's
    pieces: together, in order, the stream's bytes, and the lines shown are feed()'s."""
    splitter = LineSplitter(4)
    shown: list[bytes] = []
    stream = b""
    for chunk in chunks:
        run, pieces = splitter.split_run(chunk)
        assert run == b"" or (run.endswith(b"\n") and b"\r" not in run)
        shown += run.splitlines()
        shown += [text for text, _, visible in pieces if visible]
        stream += run + b"".join(text + end for text, end, _ in pieces)
    tail = splitter.tail()
    stream += b"".join(text for text, _, _ in tail)
    shown += [text for text, _, _ in tail]
    assert stream == b"".join(chunks)
    again = LineSplitter(4)
    assert shown == [line for chunk in chunks for line in again.feed(chunk)] + again.flush()


def test_a_run_of_lines_is_shown_as_each_line_would_be(tmp_path: Path) -> None:
    """OutputSink.lines prints, copies and remembers a run of whole lines exactly as
    OutputSink.line does each of them (prefix, colour, timestamp, stderr tail, files)."""
    texts = [b"first", b"", b"caf\xc3\xa9", b"last"]
    streams, sinks = {}, {}
    for way in ("run", "each"):
        streams[way] = (io.BytesIO(), io.BytesIO())
        options = OutputOptions(
            prefix_timestamp=True, colour_stderr=True, output_dir=str(tmp_path / way)
        )
        sinks[way] = OutputSink(*streams[way], tail_lines=3, options=options)
        sinks[way].open_files([1])
    sinks["run"].lines(1, "stderr", b"".join(text + b"\n" for text in texts))
    sinks["run"].lines(1, "stdout", b"out\n")
    for text in texts:
        sinks["each"].line(1, "stderr", text)
    sinks["each"].line(1, "stdout", b"out")
    stamp = re.compile(rb"^[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}", re.M)
    (run_out, run_err), each_err = streams["run"], streams["each"][1]
    assert stamp.sub(b"T", run_err.getvalue()) == stamp.sub(b"T", each_err.getvalue())
    assert b"\x1b[" in run_err.getvalue() and b"caf\xc3\xa9" in run_err.getvalue()
    assert stamp.sub(b"T", run_out.getvalue()) == b"T[1]<stdout>:out\n"
    assert sinks["run"].stderr_tail(1) == sinks["each"].stderr_tail(1) == ["", "café", "last"]
    for sink in sinks.values():
        sink.close()
    for name in ("stdout", "stderr"):
        copied = (tmp_path / "run" / "rank.1" / name).read_bytes()
        assert copied == (tmp_path / "each" / "rank.1" / name).read_bytes() != b""


def test_empty_lines_kept() -> None:
    assert split_all([b"\n\nz\n"]) == [b"", b"", b"z"]


def test_overlong_line_is_cut() -> None:
    assert split_all([b"abcdefghij"], max_line=4) == [b"abcd", b"efgh", b"ij"]


def test_sink_prefixes_and_keeps_stderr_tail() -> None:
    out, err = io.BytesIO(), io.BytesIO()
    sink = OutputSink(out, err, tail_lines=2)
    sink.line(3, "stdout", b"hello")
    for text in (b"one", b"two", b"three"):
        sink.line(1, "stderr", text)
    sink.message("bye")
    assert out.getvalue() == b"[3]<stdout>:hello\n"
    assert err.getvalue() == b"[1]<stderr>:one\n[1]<stderr>:two\n[1]<stderr>:three\nhvdrun: bye\n"
    assert sink.stderr_tail(1) == ["two", "three"]
    assert sink.stderr_tail(0) == []


class Terminal(io.BytesIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal_without_no_color() -> None:
    assert use_colour(Terminal(), {})
    assert not use_colour(Terminal(), {"NO_COLOR": "1"})
    assert use_colour(Terminal(), {"NO_COLOR": ""})  # no-color.org: set *and* non-empty
    assert not use_colour(io.BytesIO(), {})
    assert not use_colour(Terminal(), {"TERM": "dumb"})  # (Emacs' shell, some CI logs)


def test_coloured_prefix_per_rank() -> None:
    out, err = Terminal(), Terminal()
    sink = OutputSink(out, err, options=OutputOptions(colour_stdout=True))
    sink.line(0, "stdout", b"a")
    sink.line(11, "stdout", b"b")
    sink.line(1, "stderr", b"c")  # stderr's colour is decided separately
    assert out.getvalue() == b"\x1b[36m[0]<stdout>:\x1b[0ma\n\x1b[32m[11]<stdout>:\x1b[0mb\n"
    assert err.getvalue() == b"[1]<stderr>:c\n"


def test_timestamp_prefix() -> None:
    out = io.BytesIO()
    sink = OutputSink(out, io.BytesIO(), options=OutputOptions(prefix_timestamp=True))
    sink.line(2, "stdout", b"hi")
    assert re.fullmatch(
        rb"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[2\]<stdout>:hi\n", out.getvalue()
    )


def test_output_files_per_rank(tmp_path: Path) -> None:
    out = io.BytesIO()
    sink = OutputSink(out, io.BytesIO(), options=OutputOptions(output_dir=str(tmp_path)))
    sink.open_files(range(3))
    sink.line(1, "stdout", b"one")
    sink.line(1, "stderr", b"\xff raw bytes")
    sink.close()
    assert (tmp_path / "rank.1" / "stdout").read_bytes() == b"one\n"
    assert (tmp_path / "rank.1" / "stderr").read_bytes() == b"\xff raw bytes\n"
    assert (tmp_path / "rank.2" / "stdout").read_bytes() == b""  # every rank gets its files
    assert out.getvalue() == b"[1]<stdout>:one\n"  # and the terminal still gets the lines


def test_a_rank_whose_output_files_cannot_be_made_is_said_and_shown_here(
    tmp_path: Path,
) -> None:
    # (a full disk, a file in the way: hvdrun crashed with a traceback, and an elastic job
    # whose joining rank met it died mid-run)
    (tmp_path / "rank.1").write_text("a file where rank 1's directory goes")
    (tmp_path / "rank.0" / "stderr").mkdir(parents=True)  # (its stdout opens, its stderr not)
    out, err = io.BytesIO(), io.BytesIO()
    sink = OutputSink(out, err, options=OutputOptions(output_dir=str(tmp_path), num_ranks=3))
    sink.open_files(range(3))
    sink.open_files([1])  # (an elastic job's rank, back in its next generation: said once)
    sink.line(0, "stdout", b"zero")
    sink.line(1, "stdout", b"one")
    sink.line(2, "stdout", b"two")
    sink.close()
    assert out.getvalue() == b"[0]<stdout>:zero\n[1]<stdout>:one\n[2]<stdout>:two\n"
    assert (tmp_path / "rank.2" / "stdout").read_bytes() == b"two\n"
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b""  # (none of rank 0's kept)
    said = err.getvalue().decode().splitlines()
    assert len(said) == 2, said
    assert said[0].startswith(f"hvdrun: cannot write {tmp_path}/rank.0/stderr ")
    assert said[1].startswith(f"hvdrun: cannot write {tmp_path}/rank.1 ")
    assert said[1].endswith("rank 1's output is not kept in files"), said


def test_output_files_keep_each_line_s_own_terminator(tmp_path: Path) -> None:
    out = io.BytesIO()
    sink = OutputSink(out, io.BytesIO(), options=OutputOptions(output_dir=str(tmp_path)))
    sink.open_files([0])
    sink.line(0, "stdout", b"50%", b"\r")
    sink.line(0, "stdout", b"", b"\n", shown=False)  # (the LF of that CR, in the next chunk)
    sink.line(0, "stdout", b"done", b"\r\n")
    sink.line(0, "stdout", b"tail", b"")
    sink.close()
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b"50%\r\ndone\r\ntail"
    assert out.getvalue() == b"[0]<stdout>:50%\n[0]<stdout>:done\n[0]<stdout>:tail\n"


@pytest.mark.parametrize(
    ("num_ranks", "names"),
    [
        (1, ["rank.0"]),
        (10, ["rank.0", "rank.9"]),  # Horovod pads to the width of the largest rank
        (11, ["rank.00", "rank.09", "rank.10"]),
        (101, ["rank.000", "rank.100"]),
    ],
)
def test_rank_directories_are_zero_padded_like_horovods(num_ranks: int, names: list[str]) -> None:
    ranks = [int(name.split(".")[1]) for name in names]
    assert [rank_dir_name(rank, num_ranks) for rank in ranks] == names


def test_output_files_sort_in_rank_order(tmp_path: Path) -> None:
    options = OutputOptions(output_dir=str(tmp_path), num_ranks=12)
    sink = OutputSink(io.BytesIO(), io.BytesIO(), options=options)
    sink.open_files(range(12))
    sink.line(10, "stdout", b"ten")
    sink.close()
    assert sorted(os.listdir(tmp_path)) == [f"rank.{rank:02d}" for rank in range(12)]
    assert (tmp_path / "rank.10" / "stdout").read_bytes() == b"ten\n"


def test_status_line_stays_at_the_bottom() -> None:
    out, err = Terminal(), Terminal()
    sink = OutputSink(out, err, options=OutputOptions(status_line=True))
    sink.status("connected 1/2 hosts, 0/4 workers registered")
    sink.status("connected 1/2 hosts, 0/4 workers registered")  # unchanged: not redrawn
    sink.line(0, "stderr", b"hello")
    sink.status(None)
    assert err.getvalue() == (
        b"hvdrun: connected 1/2 hosts, 0/4 workers registered"
        b"\r\x1b[K[0]<stderr>:hello\n"
        b"hvdrun: connected 1/2 hosts, 0/4 workers registered"
        b"\r\x1b[K"
    )


def test_the_status_line_is_cut_to_the_terminal_s_width(monkeypatch: pytest.MonkeyPatch) -> None:
    # A line that wrapped left its first row behind at every redraw (the clear clears one)
    monkeypatch.setenv("COLUMNS", "30")
    out, err = Terminal(), Terminal()
    sink = OutputSink(out, err, options=OutputOptions(status_line=True))
    sink.status("rank 1 on localhost holds the others back: they waited 2.00 s")
    sink.status(None)
    assert err.getvalue() == b"hvdrun: rank 1 on localhos..." + b"\r\x1b[K"  # (29 columns)


def test_no_status_line_when_not_a_terminal() -> None:
    err = io.BytesIO()
    sink = OutputSink(io.BytesIO(), err)
    sink.status("connected 1/2 hosts")
    assert err.getvalue() == b""


class _FullDisk(io.BytesIO):
    def write(self, data: bytes) -> int:  # type: ignore[override]
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_stream_that_cannot_be_written_is_dropped_once_said(tmp_path: Path) -> None:
    """A full disk under ``> train.log`` (or a reader gone) loses the job's stdout, not the
    job: hvdrun says so once on stderr and writes the rest where it still can."""
    err = io.BytesIO()
    sink = OutputSink(_FullDisk(), err, options=OutputOptions(output_dir=str(tmp_path)))
    sink.open_files([0])
    sink.line(0, "stdout", b"one")
    sink.line(0, "stdout", b"two")
    sink.line(0, "stderr", b"warn")
    sink.message("done")
    sink.close()
    assert err.getvalue() == (
        b"hvdrun: cannot write the job's output to stdout (No space left on device): it is "
        b"dropped from now on\n[0]<stderr>:warn\nhvdrun: done\n"
    )
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b"one\ntwo\n"
    closed = OutputSink(None, None)  # hvdrun started with both descriptors closed
    closed.line(0, "stdout", b"lost")
    closed.message("lost too")


class _Stalled(io.BytesIO):
    """A stream whose writes block until ``flowing`` is set (a reader that stopped reading)."""

    def __init__(self) -> None:
        super().__init__()
        self.flowing = threading.Event()

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.flowing.wait()
        return super().write(data)


def test_a_background_sink_writes_in_order_and_never_makes_its_callers_wait() -> None:
    out, err = _Stalled(), io.BytesIO()
    sink = OutputSink(out, err, background=True, backlog_bytes=100)
    for i in range(20):  # far past the backlog's limit: queued, none written yet
        sink.line(i % 2, "stdout", b"line %d" % i)
    assert sink.backed_up() and out.getvalue() == b""

    waited = threading.Thread(target=sink.wait_for_room)  # (an agent's reader)
    waited.start()
    waited.join(0.3)
    assert waited.is_alive()  # it waits for room...
    out.flowing.set()
    waited.join(10)
    assert not waited.is_alive()  # ... until the lines are written
    sink.close()
    assert out.getvalue() == b"".join(b"[%d]<stdout>:line %d\n" % (i % 2, i) for i in range(20))


def test_lines_that_wait_to_be_written_go_out_in_few_writes_and_in_order() -> None:
    """A flood of worker lines (a reader slower than the workers) costs a write per run of
    waiting lines of one stream, not one per line; hvdrun's messages and the other stream's
    lines keep their places among them (here both streams are one terminal)."""

    class Counted(_Stalled):
        def __init__(self) -> None:
            super().__init__()
            self.writes = 0

        def write(self, data: bytes) -> int:  # type: ignore[override]
            self.writes += 1
            return super().write(data)

    terminal = Counted()
    sink = OutputSink(terminal, terminal, background=True)
    expected = []
    for i in range(500):
        sink.line(0, "stdout", b"out %d" % i)
        expected.append(b"[0]<stdout>:out %d" % i)
        if i == 250:
            sink.message("halfway")
            expected.append(b"hvdrun: halfway")
    for i in range(100):
        sink.line(1, "stderr", b"err %d" % i)
        expected.append(b"[1]<stderr>:err %d" % i)
    terminal.flowing.set()
    sink.close()
    assert terminal.getvalue().splitlines() == expected
    # (the first line alone, lines 1-250, the message, lines 251-499, the stderr lines)
    assert terminal.writes <= 5, terminal.writes


def test_a_stopping_job_drops_what_a_stuck_stdout_cannot_take() -> None:
    """Once the job stops, the agents' readers no longer wait (their reports must come
    through); what cannot be written is dropped, and said, at the end, in bounded time."""
    out, err = _Stalled(), io.BytesIO()
    sink = OutputSink(out, err, background=True, backlog_bytes=100)
    for _ in range(5):
        sink.line(0, "stdout", b"x" * 40)
    sink.message("received SIGINT; stopping all workers")
    sink.stop_waiting()
    sink.wait_for_room()  # returns at once
    for _ in range(5):
        sink.line(0, "stdout", b"y" * 40)  # over the limit while stopping: dropped
    sink.close(stuck=0.3)
    said = err.getvalue().decode()
    # hvdrun's own messages still reach stderr, first
    assert said.startswith("hvdrun: received SIGINT; stopping all workers\n"), said
    assert "could not be written for 0.3 s (a reader that stopped reading)" in said, said
    assert "5 line(s) of the job's output dropped while it stopped" in said, said
    sink.message("after the end")  # (written at once from now on)
    assert err.getvalue().endswith(b"hvdrun: after the end\n")
    out.flowing.set()


def test_a_reader_that_reads_late_gets_everything_unless_hvdrun_is_signalled() -> None:
    """At the end of a job, hvdrun waits for a reader that reads late (``| (sleep 60; cat)``)
    however long it takes, as a plain pipe would; a signal, also one that comes while it
    waits, makes the wait a bounded one."""
    out, err = _Stalled(), io.BytesIO()
    sink = OutputSink(out, err, background=True, backlog_bytes=100)
    for i in range(5):
        sink.line(0, "stdout", b"line %d" % i)
    threading.Timer(1.0, out.flowing.set).start()  # (five times ``stuck`` below)
    sink.close(interrupted=lambda: False, stuck=0.2)
    assert out.getvalue() == b"".join(b"[0]<stdout>:line %d\n" % i for i in range(5))
    assert err.getvalue() == b""

    out, err = _Stalled(), io.BytesIO()
    sink = OutputSink(out, err, background=True, backlog_bytes=100)
    sink.line(0, "stdout", b"never read")
    signalled = threading.Event()
    threading.Timer(0.5, signalled.set).start()  # (a Ctrl-C while hvdrun waits)
    start = time.monotonic()
    sink.close(interrupted=signalled.is_set, stuck=0.4)
    assert 0.5 <= time.monotonic() - start < 5
    assert b"could not be written for 0.4 s" in err.getvalue()
    out.flowing.set()


def test_output_files_get_every_line_while_stdout_is_stuck(tmp_path: Path) -> None:
    out, err = _Stalled(), io.BytesIO()
    options = OutputOptions(output_dir=str(tmp_path))
    sink = OutputSink(out, err, options=options, background=True, backlog_bytes=100)
    sink.open_files([0])
    for i in range(50):
        sink.line(0, "stdout", b"line %d" % i)
    sink.stop_waiting()  # (lines over the limit are now dropped from the terminal...)
    sink.line(0, "stdout", b"last", b"")
    sink.close(stuck=0.2)
    expected = b"".join(b"line %d\n" % i for i in range(50)) + b"last"
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == expected  # (... not from the file)
    out.flowing.set()


def test_a_slow_write_after_a_quiet_stretch_is_not_taken_for_a_stuck_reader() -> None:
    class Slow(io.BytesIO):
        def write(self, data: bytes) -> int:  # type: ignore[override]
            time.sleep(0.2)
            return super().write(data)

    out, err = Slow(), io.BytesIO()
    sink = OutputSink(out, err, background=True)
    time.sleep(0.5)  # quiet for longer than ``stuck`` below
    sink.line(0, "stdout", b"one")
    sink.line(0, "stdout", b"two")
    sink.close(stuck=0.3)
    assert out.getvalue() == b"[0]<stdout>:one\n[0]<stdout>:two\n"
    assert err.getvalue() == b""

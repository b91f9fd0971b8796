import io

from launcher.output import LineSplitter, OutputSink


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

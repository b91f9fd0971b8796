"""Starts and supervises a job's workers; owns the rendezvous server's lifetime.

``launcher`` imports ``rendezvous`` (never ``collectives``) and never imports torch.
"""

"""Request logs as vLLM's (server/request_policy.py): nothing per request by default, ``--enable-log-requests`` logs
id, lengths and a bounded parameter summary at INFO, the prompt only at DEBUG, ``--max-log-len`` bounds every field,
``--disable-log-requests`` is an accepted no-op."""
from __future__ import annotations

import logging
import os

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import serve_subprocess

from tokenfab.sampling_params import SamplingParams
from tokenfab.server.request_policy import RequestPolicy

PROMPT = ("The secret passphrase is zebra-orchid-42. " * 400)[:15000]  # 15 KB


def _records(caplog):
    return [r for r in caplog.records if r.name == "tokenfab.requests"]


def _huge_params():
    return SamplingParams(max_tokens=5, logit_bias={i: 1.0 for i in range(49152)}, stop=["y" * 3000],
                          allowed_token_ids=list(range(40000)))


def test_log_lines_are_bounded_and_info_holds_no_prompt(caplog):
    """A 15 KB prompt, 4,000 token ids and a 49,152-entry logit_bias: one INFO line of under 1 KB with the id,
    lengths and sizes, no prompt text (before: a 600 KB INFO line holding the whole prompt and every id)."""
    policy = RequestPolicy(log_requests=True)
    with caplog.at_level(logging.INFO, "tokenfab.requests"):
        policy.admit("cmpl-1", PROMPT, list(range(4000)), _huge_params())
    recs = _records(caplog)
    assert [r.levelno for r in recs] == [logging.INFO]
    msg = recs[0].getMessage()
    assert len(msg) < 1000, len(msg)
    assert msg.startswith("Received request cmpl-1: prompt_tokens 4000, prompt_chars 15000, params: ")
    assert "logit_bias=<49152 entries>" in msg and "allowed_token_ids=<40000 entries>" in msg
    assert "max_tokens=5" in msg and "zebra" not in msg and "temperature" not in msg  # defaults left out


def test_prompt_only_at_debug_and_max_log_len_bounds_every_field(caplog):
    policy = RequestPolicy(log_requests=True, max_log_len=40)
    with caplog.at_level(logging.DEBUG, "tokenfab.requests"):
        policy.admit("cmpl-2", PROMPT, list(range(4000)), _huge_params())
    recs = _records(caplog)
    assert [r.levelno for r in recs] == [logging.INFO, logging.DEBUG]
    info, debug = (r.getMessage() for r in recs)
    assert "zebra" not in info and len(info) < 500, info
    assert f"prompt: {repr(PROMPT[:40])[:-1]}...(+14960 chars)'" in debug  # the prompt, cut to 40 characters
    assert "prompt_token_ids: [0, 1, 2" in debug and ", 39]...(+3960 ids)" in debug
    assert len(debug) < 500, debug


def test_no_request_log_by_default(caplog):
    """The policy a server gets without --enable-log-requests logs nothing per request, even at DEBUG."""
    from tokenfab.cli import build_parser
    args = build_parser().parse_args(["serve", "--disable-log-requests"])  # accepted, changes nothing
    assert args.enable_log_requests is False and args.disable_log_requests is True
    assert build_parser().parse_args(["serve", "--enable-log-requests"]).enable_log_requests is True
    with caplog.at_level(logging.DEBUG, "tokenfab.requests"):
        RequestPolicy().admit("cmpl-3", PROMPT, [1, 2, 3], SamplingParams())
    assert _records(caplog) == []


def test_serve_enable_log_requests_end_to_end(server_model_dir, tmp_path):
    """`tokenfab serve --enable-log-requests --disable-log-requests --max-log-len 30` in its own process: one bounded
    INFO line per request on stdout, without the prompt text."""
    env = dict(os.environ, VLLM_API_KEY="", TOKENFAB_API_KEY="", TOKENFAB_CPU_KERNELS="0")
    env.pop("TOKENFAB_LOGGING_LEVEL", None)
    with serve_subprocess([server_model_dir, "--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
                           "--num-threads", "1", "--enable-log-requests", "--disable-log-requests", "--max-log-len",
                           "30"], tmp_path / "serve.log", env) as base:
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": "zebra orchid " * 8, "max_tokens": 2, "logit_bias": {str(i): 0.5 for i in range(512)}})
        assert r.status_code == 200, r.text
    lines = [x for x in open(tmp_path / "serve.log").read().splitlines() if "[requests]" in x]
    assert len(lines) == 1 and "Received request cmpl-" in lines[0], lines
    assert "zebra" not in lines[0] and "logit_bias=<512 entries>" in lines[0] and len(lines[0]) < 400, lines[0]

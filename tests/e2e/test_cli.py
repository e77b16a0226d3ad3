"""The command line: one flag set for every server entry point, derived from the config declarations;
chat on a base model is a clear error unless a template is given."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from swaserve.cli import build_parser
from swaserve.config import CacheConfig, RunnerConfig, SchedulerConfig, ServerConfig
from swaserve.options import add_serve_flags, engine_options, server_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def test_serve_entry_points_take_the_same_flags():
    module_parser = argparse.ArgumentParser()
    add_serve_flags(module_parser)
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert _flags(serve) == _flags(module_parser)
    flags = _flags(serve)
    for flag in ("--log-level", "--graceful-timeout", "--access-log", "--max-body-bytes", "--stream-interval",
                 "--chat-template", "--schedule-policy", "--max-running-requests", "--kv-cache-mb",
                 "--data-parallel-size"):
        assert flag in flags
    assert "--engine-option" not in flags and "--max-body-mb" not in flags


def test_flags_map_to_config_fields():
    args = build_parser().parse_args([
        "serve", "--max-running-requests", "8", "--kv-cache-mb", "3", "--disable-overlap-schedule",
        "--schedule-policy", "prefill_first", "--stream-interval", "4", "--port", "0", "--access-log",
    ])
    opts = engine_options(args)
    assert opts == {"max_running_requests": 8, "kv_cache_bytes": 3 << 20, "overlap_schedule": False,
                    "schedule_policy": "prefill_first"}
    cfg = server_config(args)
    assert cfg.stream_interval == 4 and cfg.port == 0 and cfg.access_log and cfg.log_level == "warning"
    # Every engine flag names a config field; nothing given means the declared defaults.
    assert engine_options(build_parser().parse_args(["serve"])) == {}
    assert server_config(build_parser().parse_args(["serve"])) == ServerConfig()
    fields = {*CacheConfig.__dataclass_fields__, *SchedulerConfig.__dataclass_fields__, *RunnerConfig.__dataclass_fields__}
    assert set(engine_options(args)) <= fields
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--schedule-policy", "fastest"])


def _cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swaserve", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_chat_on_base_model_is_an_error():
    r = _cli("generate", "Write a haiku about memory", "--chat", "--max-tokens", "4")
    assert r.returncode == 2, r.stderr
    assert "no chat template" in r.stderr and "--chat-template" in r.stderr
    r = _cli("generate", "hi", "--chat", "--chat-template", "/nonexistent/template.jinja")
    assert r.returncode == 2 and "chat template file not found" in r.stderr


def test_chat_with_explicit_template_and_plain_completion(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}Q: {{ m['content'] }}\nA:{% endfor %}")
    r = _cli("generate", "The capital of France is", "--chat", "--chat-template", str(template), "--max-tokens", "3",
             "--device", "cpu", "--max-context", "256")
    assert r.returncode == 0, r.stderr
    plain = _cli("generate", "The capital of France is", "--max-tokens", "3", "--device", "cpu", "--max-context", "256")
    assert plain.returncode == 0 and plain.stdout.strip(), plain.stdout + plain.stderr


@pytest.mark.slow  # ~10 s: a subprocess loads torch, the 201k-token tokenizer and the model
def test_gpt_oss_chat_uses_harmony(tmp_path):
    """--chat on GPT-OSS (the tiny directory, random weights): rendered by harmony, the vocabulary
    regenerated from its tokenizer.json; --chat-template does not apply to it."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from harmony_model import gpt_oss_dir

    model = str(gpt_oss_dir())
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_ENCODINGS_BASE"}
    env["SWASERVE_CACHE"] = str(tmp_path)
    argv = [sys.executable, "-m", "swaserve", "generate", "hi", "--chat", "--model", model, "--load-format", "dummy",
            "--max-tokens", "6", "--device", "cpu", "--max-context", "256"]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr  # random weights: no harmony message, all content
    assert (tmp_path / "harmony" / "o200k_base.tiktoken").is_file()
    r = _cli("generate", "hi", "--chat", "--model", model, "--chat-template", "gemma")
    assert r.returncode == 2 and "harmony format" in r.stderr

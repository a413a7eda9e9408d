"""The `conveyor` command's answers to bad input: an error naming the flag and exit status 2,
before any work, never a traceback (what a probe of every subcommand found)."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import pytest

from conveyor.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser, path: str = "conveyor"
             ) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{path} {name}")
    return found


def test_every_command_prints_its_help() -> None:
    # argparse %-formats help texts: a bare "%" in one field's help once made `conveyor serve
    # --help` and every bench command's help a traceback
    parsers = _parsers(build_parser())
    assert {"conveyor serve", "conveyor bench offline"} <= {path for path, _ in parsers}
    for path, parser in parsers:
        text = parser.format_help()
        assert text.startswith("usage: " + path), path


@pytest.mark.parametrize("argv,words", [
    (["simulate", "--request-rate", "0"], "--request-rate must be > 0"),
    (["simulate", "--request-rate", "nan"], "--request-rate must be > 0"),
    (["simulate", "--burstiness", "0", "--request-rate", "8"], "--burstiness must be > 0"),
    (["simulate", "--model", "llama-3-8b", "--device", "H100-80GB", "--sweep",
      "request_rate=0,1"], "--request-rate must be > 0"),
    (["serve", "--api-key", ""], "api_key must be a non-empty key"),
    (["serve", "--uvicorn-log-level", "bogus"], "uvicorn_log_level must be one of"),
    (["generate", "Hi", "--system", "Be brief."], "--system needs --chat"),
    (["serve", "--routing", "prefix"], "replicas (--replicas) must be set for --routing"),
    (["serve", "--ray-address", "auto"], "replicas (--replicas) must be set"),
    (["serve", "--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' cannot be"),
    (["serve", "a.gguf", "--model", "b.gguf"], "the model is given twice"),
    (["serve", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call"),
])
def test_bad_values_name_their_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                    words: str) -> None:
    assert main(argv) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["--log-level", "bogus", "plan"], "argument --log-level: invalid choice"),
    (["bench", "offline", "--num-requests", "0"], "--num-requests: must be an integer >= 1"),
    (["bench", "compare", "--hol-num-requests", "-4"], "must be an integer >= 1"),
    (["bench", "compare", "--hol-prompt-len", "64", "16"], "MIN 64 is above MAX 16"),
    (["bench", "sweep", "--roofline-context-len", "-5"], "must be an integer >= 1"),
    (["generate", "Hi", "--n", "2"], "unrecognized arguments: --n"),  # no abbreviations
    (["generate", "Hi", "--max-tok", "2", "--model", "/nonexistent.gguf"],
     "unrecognized arguments: --max-tok"),
])
def test_bad_flags_are_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str],
                                    words: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_vllm_serve_spellings() -> None:
    """`vllm serve MODEL` (the model positional), -tp, --enable-auto-tool-choice beside
    --tool-call-parser: a vLLM user's command line works as typed."""
    from conveyor.server.cli import server_config, server_engine_args

    args = build_parser().parse_args(["serve", "model.gguf", "-tp", "2", "--tool-call-parser",
                                      "hermes", "--enable-auto-tool-choice"])
    engine = server_engine_args(args)
    assert (engine.model, engine.tensor_parallel_size) == ("model.gguf", 2)
    assert server_config(args).tool_call_parser == "hermes"
    same = build_parser().parse_args(["serve", "model.gguf", "--model", "model.gguf"])
    assert server_engine_args(same).model == "model.gguf"


def test_output_paths_are_checked_before_the_work(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    folder, file = tmp_path / "adir", tmp_path / "afile"
    folder.mkdir()
    file.write_text("")
    for argv, words in (
            (["simulate", "--result-file", str(folder)], "is a directory, not a file"),
            (["simulate", "--result-file", str(file / "x.json")], "cannot be written"),
            (["simulate", "--plot-dir", str(file)], "is a file, not a folder"),
            (["bench", "profile", "--output", str(tmp_path / "no" / "p.json")],
             "cannot be written")):
        assert main(argv) == 2, argv
        assert words in capsys.readouterr().err


def test_a_port_in_use_is_refused_before_the_model_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["serve", "--port", str(port)]) == 2
        assert time.monotonic() - started < 5  # no model was loaded
    assert f"--port {port} on 127.0.0.1" in capsys.readouterr().err


def test_building_the_parser_imports_no_torch() -> None:
    """`conveyor plan` and `--help` must not pay for torch (~2 s): every command's parser is
    built without it (a fresh interpreter: this one has torch already)."""
    import subprocess
    import sys

    code = ("import sys\nfrom conveyor.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


def test_served_model_names_do_not_swallow_the_model(tmp_path: Path) -> None:
    """--served-model-name takes several names (vLLM's): a model path given after it would
    be taken for a name, and the default model served instead; that is an error."""
    from conveyor.server.cli import server_engine_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--served-model-name", "foo", str(tmp_path)])
    with pytest.raises(ValueError, match="give the model first"):
        server_engine_args(args)
    named = parser.parse_args(["serve", str(tmp_path), "--served-model-name", "foo", "bar"])
    assert server_engine_args(named).served_model_name == ("foo", "bar")

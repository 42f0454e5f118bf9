import subprocess
import sys

import pytest

from autodeploy.cli import build_parser, compile_options, main


def test_help_documents_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("compile", "check", "tiny"):
        assert command in out


# every command's --help, and serve's settings parsed and printed, in one fresh interpreter
NO_TORCH_SCRIPT = """
import sys
from autodeploy.cli import main
for argv in (["--help"], ["serve", "--help"], ["compile", "--help"], ["bench", "serve", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
assert main(["serve", "org/model", "--print_config", "--max-model-len", "64"]) == 0
heavy = sorted(m for m in ("torch", "transformers", "numpy", "safetensors") if m in sys.modules)
assert not heavy, f"parsing the command line imported {heavy}"
"""


def test_help_and_settings_import_no_torch():
    """``autodeploy --help`` answers at once: argument parsing imports neither torch nor transformers."""
    result = subprocess.run([sys.executable, "-c", NO_TORCH_SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--max-model-len" in result.stdout and "max_seq_len: 64" in result.stdout


def test_settings_precedence_defaults_yaml_flags_set(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("max_batch_size: 8\nmax_num_tokens: 100\ndtype: float16\npasses: {gather_logits: {enabled: true}}\n")
    args = build_parser().parse_args([
        "compile", "m", "--config", str(config), "--max_num_tokens", "200", "--max-seq-len", "64",
        "--set", "dtype=float32", "--set", "passes.canonicalize_moe.enabled=false",
    ])
    options = compile_options(args)
    assert options["max_batch_size"] == 8  # YAML over default
    assert options["max_num_tokens"] == 200  # flag over YAML
    assert options["max_seq_len"] == 64  # dash alias
    assert options["dtype"] == "float32"  # --set over YAML
    assert options["passes"] == {"gather_logits": {"enabled": True}, "canonicalize_moe": {"enabled": False}}


def test_invalid_settings_exit_with_a_message(capsys, tiny_llama):
    assert main(["compile", str(tiny_llama), "--set", "max_batch_size=0"]) == 2
    assert "max_batch_size" in capsys.readouterr().err


def test_compile_prints_pass_table_and_op_counts(capsys, tiny_llama, tmp_path):
    dump = tmp_path / "graphs"
    code = main(["compile", str(tiny_llama), "--device", "cpu", "--dump-graphs", str(dump)])
    out = capsys.readouterr().out
    assert code == 0
    assert "canonicalize_attention" in out and "paged_attention=2" in out
    assert "KV cache (float32):" in out and any(dump.iterdir())


def test_check_passes_on_a_good_model(capsys, tiny_llama):
    assert main(["check", str(tiny_llama), "--device", "cpu", "--steps", "3", "--prompt_lens", "4,9"]) == 0
    assert capsys.readouterr().out.startswith("PASS")

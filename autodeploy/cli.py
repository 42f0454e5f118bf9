"""The ``autodeploy`` command line.

Built-in subcommands: ``compile`` (per-pass table and canonical-op counts, or with ``--print-plan``
the tensor-parallel plan), ``check`` (the
correctness canary against HF eager) and ``tiny`` (write a tiny random checkpoint). Other packages
add subcommands through ``SUBCOMMANDS`` (lazy ``"module:function"`` entries taking the subparsers).
Flags use TensorRT-LLM's underscore spelling; the dash spelling is accepted too.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Callable

from .config import CompileConfig, load_yaml, merge_settings, parse_set_option, set_dotted, validate
from .errors import AutoDeployError, ConfigError
from .registry import Registry

SUBCOMMANDS: Registry[Callable[[Any], None]] = Registry("subcommand", entry_point_group="autodeploy.cli")
SUBCOMMANDS.register_lazy("serve", "autodeploy.serve.cli:add_serve_command")
SUBCOMMANDS.register_lazy("bench", "autodeploy.serve.cli:add_bench_command")

# CompileConfig fields exposed as dedicated flags (name, type)
COMPILE_FLAGS: list[tuple[str, type]] = [
    ("dtype", str), ("device", str), ("max_seq_len", int), ("max_batch_size", int), ("max_num_tokens", int),
    ("tokens_per_block", int), ("kv_cache_free_gpu_memory_fraction", float), ("gpu_memory_utilization", float),
    ("num_kv_blocks", int), ("attn_implementation", str), ("attention_backend", str), ("weights", str),
    ("pipeline", str), ("tp_size", int), ("quantization", str), ("revision", str),
]
COMPILE_SWITCHES = ["trust_remote_code", "allow_pickle", "enforce_eager"]  # CompileConfig booleans a bare flag sets
# other spellings of the same flags: vLLM's names where they differ, trtllm-serve's older ones
SPELLINGS: dict[str, tuple[str, ...]] = {
    "max_batch_size": ("--max-num-seqs",), "max_seq_len": ("--max-model-len",),
    "max_num_tokens": ("--max-num-batched-tokens",), "tp_size": ("--tensor-parallel-size", "-tp"),
    "kv_cache_free_gpu_memory_fraction": ("--free_gpu_memory_fraction",), "quantization": ("-q",),
    "config": ("--extra_llm_api_options",), "tokens_per_block": ("--block-size",),
}
def flag(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """Add ``--name`` (underscore, as trtllm-serve) with the ``--dash-name`` alias (as vllm serve) and
    the other spellings ``SPELLINGS`` lists, all of them shown in ``--help``."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else []) + list(SPELLINGS.get(name, ()))
    if kwargs.get("help") and kwargs["help"] != argparse.SUPPRESS:
        kwargs["help"] = kwargs["help"].replace("%", "%%")  # (argparse formats help with %)
    parser.add_argument(*spellings, dest=name, **kwargs)


def add_compile_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that compiles a model."""
    fields = CompileConfig.model_fields
    for name, kind in COMPILE_FLAGS:
        flag(parser, name, type=kind, default=None, help=fields[name].description)
    for name in COMPILE_SWITCHES:
        flag(parser, name, action="store_true", default=None, help=fields[name].description)
    flag(parser, "kv_cache_dtype", default=None, metavar="DTYPE",
         help=CompileConfig.model_fields["kv_cache_dtype"].description + " (as vLLM's --kv-cache-dtype)")
    flag(parser, "config", default=None, metavar="FILE.yaml", help="YAML file of settings (below dedicated flags)")
    parser.add_argument("--set", dest="set_options", action="append", default=[], metavar="KEY=VALUE",
                        help="override any setting, dotted keys for nesting (highest precedence; repeatable)")
    flag(parser, "log_level", default="warning", choices=["debug", "info", "warning", "error"], help="logging level")


def compile_flag_names() -> list[str]:
    """Every flag that sets a compile option."""
    return [n for n, _ in COMPILE_FLAGS] + COMPILE_SWITCHES + ["kv_cache_dtype"]


def settings_from_args(args: argparse.Namespace, flag_names: list[str], yaml_key: str | None = None) -> dict[str, Any]:
    """defaults < --config YAML < dedicated flags < --set, as one dict."""
    from_yaml = load_yaml(args.config) if getattr(args, "config", None) else {}
    if yaml_key is not None:
        from_yaml = from_yaml.get(yaml_key, from_yaml)
    from_flags = {n: getattr(args, n) for n in flag_names if getattr(args, n, None) is not None}
    from_set: dict[str, Any] = {}
    for item in args.set_options:
        key, value = parse_set_option(item)
        set_dotted(from_set, key, value)
    return merge_settings(from_yaml, from_flags, from_set)


def compile_options(args: argparse.Namespace) -> dict[str, Any]:
    settings = settings_from_args(args, compile_flag_names())
    if getattr(args, "dump_graphs", None):
        settings["dump_dir"] = args.dump_graphs
    return validate(CompileConfig, settings, "settings").model_dump(exclude_unset=True)


def cmd_compile(args: argparse.Namespace) -> int:
    from .compiler import compile as compile_model

    if args.print_plan:
        from .passes.shard import plan_for_checkpoint

        print("\n".join(plan_for_checkpoint(args.model_dir, **compile_options(args)).lines()))
        return 0
    model = compile_model(args.model_dir, **compile_options(args))
    report = model.report
    print(f"model: {report.architecture} ({report.model_type}), dtype {report.dtype}, device {report.device}")
    print("stages: " + ", ".join(f"{k} {v:.2f} s" for k, v in report.stage_seconds.items()))
    print(report.pass_table())
    print("canonical ops: " + ", ".join(f"{k}={v}" for k, v in report.op_counts.items()))
    print("quantization: " + "\n  ".join(report.quantization_lines()))
    print(model.capacity.describe())
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .check import run_check

    lens = tuple(int(x) for x in args.prompt_lens.split(","))
    result = run_check(args.model_dir, steps=args.steps, prompt_lens=lens, chunk_size=args.chunk_size,
                       rel_tol=args.rtol, **compile_options(args))
    print(result.summary())
    return 0 if result.passed else 1


def cmd_tiny(args: argparse.Namespace) -> int:
    from .tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(args.model_type, args.out_dir)
    print(f"wrote a tiny random {args.model_type} checkpoint to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autodeploy", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compile", help="compile a checkpoint; print the per-pass table and canonical-op counts")
    p.add_argument("model_dir", help="HF checkpoint directory (config.json + *.safetensors), a .gguf file, or a "
                                     "Hugging Face Hub id")
    flag(p, "dump_graphs", metavar="DIR", help="write every intermediate graph to DIR")
    flag(p, "print_plan", action="store_true",
         help="print the tensor-parallel plan for --tp_size (no weights loaded, no processes) and exit")
    add_compile_options(p)
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("check", help="correctness canary: compiled model vs HF eager; exits 1 on mismatch")
    p.add_argument("model_dir", help="HF checkpoint directory, a .gguf file, or a Hugging Face Hub id")
    p.add_argument("--steps", type=int, default=16, help="greedy decode steps after the prompts (default 16)")
    flag(p, "prompt_lens", default="5,23,12,40", help="comma-separated prompt lengths (default 5,23,12,40)")
    flag(p, "chunk_size", type=int, default=16, help="prefill chunk size (default 16)")
    p.add_argument("--rtol", type=float, default=1e-4, help="max relative logit error (default 1e-4)")
    flag(p, "dump_graphs", metavar="DIR", help="write every intermediate graph to DIR")
    add_compile_options(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("tiny", help="write a tiny random checkpoint of a HF architecture (for trying things out)")
    p.add_argument("model_type", help="HF model_type, e.g. llama, qwen3, gemma2, mixtral")
    p.add_argument("out_dir")
    p.set_defaults(func=cmd_tiny)

    for name in SUBCOMMANDS.names():
        try:
            SUBCOMMANDS.get(name)(sub)
        except ImportError as exc:  # an optional part is not installed: say so when it is used
            p = sub.add_parser(name, help=f"(unavailable: {exc})")
            p.set_defaults(func=lambda _a, exc=exc: _unavailable(exc))
    return parser


def _unavailable(exc: Exception) -> int:
    print(f"error: this command is unavailable: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(getattr(args, "log_level", "warning")).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except AutoDeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""GPU smoke test: the correctness canary on a tiny model on CUDA, for each attention backend given.

    python bench/gpu_smoke.py torch triton
"""

import sys
import tempfile

import torch


def main() -> None:
    from autodeploy.check import run_check
    from autodeploy.tiny import make_tiny_checkpoint

    print("torch", torch.__version__, "device", torch.cuda.get_device_name(0), flush=True)
    tmp = tempfile.mkdtemp()
    failed = False
    for arch in ("llama", "gemma2", "qwen3"):
        path = make_tiny_checkpoint(arch, f"{tmp}/{arch}")
        for backend in sys.argv[1:] or ["torch"]:
            res = run_check(path, device="cuda", attention_backend=backend)
            failed |= not res.passed
            print(f"tiny {arch} canary on cuda ({backend}, fp32):", res.summary(), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

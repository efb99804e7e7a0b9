"""What a freshly started training process pays once, component by component (GPU machine).

    python -m megadyn.bench startup            # one JSON line per component

Each component runs in a new Python process, as a restarted worker would: the interpreter,
`import torch`, CUDA's context, the imports of pretrain_gpt.py, and the first against the
second call of cuDNN attention (forward and backward, the reference shape) and of the
fused (Triton) vocab-parallel cross entropy. The recovery path of a restarted job pays each of these
(megadyn/launch/startup.py logs where its own start went).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

ATTENTION = """
import time, torch, torch.nn.functional as F
from megadyn.models.attention import attention_kernels
q, k, v = (torch.randn(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
times = []
for _ in range(2):
    torch.cuda.synchronize(); t = time.perf_counter()
    with attention_kernels("auto", q):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    torch.cuda.synchronize(); times.append(time.perf_counter() - t)
print(times)
"""

CROSS_ENTROPY = """
import time, torch
from megadyn.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
logits = torch.randn(2048, 2, 50304, device="cuda", dtype=torch.bfloat16, requires_grad=True)
target = torch.randint(0, 50304, (2048, 2), device="cuda")
times = []
for _ in range(2):
    torch.cuda.synchronize(); t = time.perf_counter()
    vocab_parallel_cross_entropy(logits, target, 0, None, fused=True).mean().backward()
    torch.cuda.synchronize(); times.append(time.perf_counter() - t)
print(times)
"""

WHOLE = {  # component: code, timed from before the interpreter starts to its exit
    "interpreter": "pass",
    "import torch": "import torch",
    "import torch + CUDA context": "import torch; torch.zeros(1, device='cuda')",
    "import pretrain_gpt": "import pretrain_gpt",
}
FIRST_SECOND = {"cuDNN attention fwd+bwd": ATTENTION, "fused cross entropy": CROSS_ENTROPY}


def run(code: str) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return time.perf_counter() - start, out.stdout.strip()


def main() -> None:
    for name, code in WHOLE.items():
        seconds, _ = run(code)
        print(json.dumps({"component": name, "process_s": round(seconds, 2)}), flush=True)
    for name, code in FIRST_SECOND.items():
        seconds, out = run(code)
        first, second = json.loads(out.splitlines()[-1])
        print(
            json.dumps(
                {
                    "component": name,
                    "first_call_s": round(first, 3),
                    "second_call_s": round(second, 4),
                    "process_s": round(seconds, 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

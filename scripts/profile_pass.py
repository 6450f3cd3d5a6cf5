"""Where one method's decoding time goes: torch-profile a generation on the embedded target and
print the matrix-multiply time per input shape (the target's verification linears, the drafter's
layers and LM head), per verification pass.

    python scripts/profile_pass.py --method dflash --max-new-tokens 48 --threads 1
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from dcoco import LLM, SamplingParams

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--method", default="dflash")
p.add_argument("--max-new-tokens", type=int, default=48)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--prompt", default="Write a short story about a robot.")
args = p.parse_args()
torch.set_num_threads(args.threads)
llm = LLM(dtype="bfloat16")
spec = None if args.method == "vanilla" else {"method": args.method}
llm.generate("Hello", SamplingParams(max_tokens=4), speculative_config=spec)  # warm-up
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    llm.generate(args.prompt, SamplingParams(max_tokens=args.max_new_tokens), speculative_config=spec)
passes = max(1, llm.last_stats.verify_passes)
rows = prof.key_averages(group_by_input_shape=True)
total = sum(r.self_cpu_time_total for r in rows) / 1e3
mm = sorted(((r.self_cpu_time_total / 1e3, r.count, r.input_shapes) for r in rows if r.key == "aten::mm"), reverse=True)
print(
    f"{args.method}: {total:.0f} ms profiled, {sum(t for t, _, _ in mm):.0f} ms in matrix multiplies, {passes} passes"
)
print("   ms total   ms/pass  calls  input shapes")
for t, n, shapes in mm[:10]:
    print(f"{t:10.1f} {t / passes:9.2f} {n:6d}  {shapes}")

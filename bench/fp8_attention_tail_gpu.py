"""The engine's FP8 attention kernel with and without the last wave's query blocks split (``tail_split``).

At the engine's shapes (Wan 2.1 1.3B at 832x480: 4,680 queries, 12 heads of 128, keys Sk in {18,720, 32,760},
history = Sk - 4,680; bench/fp8_attention_gpu.py's ``engine_inputs``), per Sk: the default config whole and
split, ms (do_bench, L2 flushed), TFLOP/s, NaN count of a NaN-poisoned output, error against float32 attention and
between the two. Then the wave probe: the default config at 32,760 keys over 4,224, 4,680 and 5,632 queries
(exactly 3, 3.36 and 4 waves of 64-row programs, two an SM on 132 SMs): if 4,680 costs about what 5,632 does, the
partial last wave costs a whole one. ONE JSON line on stdout.

    python3 bench/fp8_attention_tail_gpu.py
"""

from __future__ import annotations

import dataclasses
import json
import sys

sys.path.insert(0, ".")

import torch

from bench.fp8_attention_gpu import (
    WAN_480P,
    describe,
    float32_attention,
    quantized_engine_operands,
    rel_err,
    sync,
    time_ms,
)
from engine.models import fp8_attention as fa

SK_VALUES = (18720, 32760)
PROBE_QUERIES = (4224, 4680, 5632)


def main() -> None:
    device = torch.device("cuda")
    record = {"bench": "fp8_attention_tail", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "sms": torch.cuda.get_device_properties(device).multi_processor_count, "per_sk": {}}
    for sk in SK_VALUES:
        q, k, v, sh, operands = quantized_engine_operands(WAN_480P, sk, device)
        ref32 = float32_attention(q, k, v)
        base = dataclasses.replace(fa.default_config(128, sk), tail_split=False)
        outs, per = {}, {"config": dataclasses.asdict(base)}
        for name, config in (("whole", base), ("split", dataclasses.replace(base, tail_split=True))):
            out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=device)
            try:
                fa.fp8_attention_segments(*operands, sh, out=out, config=config)
                sync(device)
                row = {"nan_count": int(out.isnan().sum().item()), "rel_err_fp32": rel_err(out, ref32),
                       "ms": time_ms(lambda config=config, out=out: fa.fp8_attention_segments(
                           *operands, sh, out=out, config=config), device)}
                row["tflops"] = WAN_480P.tflops(row["ms"], sk)
                outs[name] = out
            except Exception as error:  # noqa: BLE001 - report, keep going
                row = {"error": describe(error)}
                sync(device)
            per[name] = row
            print(f"Sk={sk} {name} {row}", file=sys.stderr, flush=True)
        if len(outs) == 2:
            per["rel_split_vs_whole"] = rel_err(outs["split"], outs["whole"])
        record["per_sk"][sk] = per
    # The wave probe at 32,760 keys: q rows repeated past 4,680 for 5,632 (their values do not matter here).
    _, _, _, sh, (q8, q_scale, *segments) = quantized_engine_operands(WAN_480P, 32760, device)
    bits = q8.view(torch.uint8)
    config = dataclasses.replace(fa.default_config(128, 32760), tail_split=False)
    record["wave_probe_ms"] = {}
    for sq in PROBE_QUERIES:
        rows = torch.cat([bits] * (-(-sq // bits.shape[1])), dim=1)[:, :sq].contiguous().view(fa.FP8_DTYPE)
        out = torch.empty(rows.shape, dtype=torch.bfloat16, device=device)
        record["wave_probe_ms"][sq] = time_ms(
            lambda rows=rows, out=out: fa.fp8_attention_segments(rows, q_scale, *segments, sh, out=out,
                                                                 config=config), device)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

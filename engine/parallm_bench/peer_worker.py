"""`parallm bench`'s peer: transformers + torch static batched ``generate``, in a process of its own.

Run as a script (``python peer_worker.py MODEL_DIR PROMPTS_JSON NEW_TOKENS DTYPE``), never imported
through the package: importing ``parallm_engine`` preloads a CBLAS and starts MLX, and in the engine's
process torch's fp32 ``generate`` ran 3x slower than alone (75 vs 238 tok/s measured), which is not
the alternative a user would run. Prints one JSON line: tokens, wall_s.
"""

import json
import sys
import time


def main(model_dir: str, prompts_path: str, new_tokens: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    with open(prompts_path) as fh:
        prompts = json.load(fh)
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).eval()
    ids = torch.tensor(prompts)
    attn = torch.ones_like(ids)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        # Warm-up: oneDNN builds its kernels on first use.
        model.generate(ids[:2, :8], attention_mask=attn[:2, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=attn, **kw)
        wall = time.perf_counter() - t0
    return {"tokens": int((out.shape[1] - ids.shape[1]) * ids.shape[0]), "wall_s": wall,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])))

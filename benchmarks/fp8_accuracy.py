"""FP8 weights (or an FP8 KV cache) against the bf16 model they come from: teacher-forced logprobs over 8 sequences of 256 tokens
(mean and max |dlogprob| of each sequence's own tokens, top-1 agreement of the next-token predictions), and greedy
generations of 32 prompts under the top-5 rule (equal, or at the first divergence each side's token is among the
other's top 5).

    python benchmarks/fp8_accuracy.py MODEL [--device cuda] [--fp8-model FOLDER] [--fp8 weights|kv-cache]

MODEL: a bf16 model folder (or None for the default model); the FP8 side is MODEL with quantization="fp8", or
--fp8-model (an FP8 checkpoint of the same model); with --fp8 kv-cache, MODEL with kv_cache_dtype="fp8" (bf16
weights, an e4m3 KV cache). The teacher sequences are the bf16 model's own greedy text after
short random prompts, so that both models are scored on text one of them finds likely."""
import argparse
import gc
import statistics

import torch

from nanograph import LLM, SamplingParams

NUM_TEACHER, TEACHER_LEN = 8, 256
NUM_GREEDY, GREEDY_LEN = 32, 64


def prompts(vocab: int, count: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, min(vocab, 20000), (length,), generator=g).tolist()}
            for _ in range(count)]


def teacher_sequences(llm: LLM) -> list[list[int]]:
    outs = llm.generate(prompts(llm.engine.vocab_size, NUM_TEACHER, 8, seed=1),
                        SamplingParams(temperature=0, max_tokens=TEACHER_LEN - 8, ignore_eos=True), use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def scored(llm: LLM, sequences: list[list[int]]) -> list[list[tuple[float, int]]]:
    """Per sequence, per position after the first: (logprob of the sequence's token, the top-1 token)."""
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    result = []
    for seq, out in zip(sequences, outs):
        rows = []
        for token, entry in zip(seq[1:], out.prompt_logprobs[1:]):
            top1 = next(t for t, lp in entry.items() if lp.rank == 1)
            rows.append((entry[token].logprob, top1))
        result.append(rows)
    return result


def greedy(llm: LLM) -> list:
    outs = llm.generate(prompts(llm.engine.vocab_size, NUM_GREEDY, 16, seed=2),
                        SamplingParams(temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def top5_rule(a, b) -> bool:
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            return x in b.logprobs[i] and y in a.logprobs[i]
    return True


def run(model: str | None, fp8_model: str | None, fp8: str = "weights", **llm_kwargs) -> dict:
    bf16 = LLM(model, **llm_kwargs)
    sequences = teacher_sequences(bf16)
    ref_scores, ref_greedy = scored(bf16, sequences), greedy(bf16)
    del bf16
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if fp8 == "kv-cache":
        fp8_llm = LLM(model, kv_cache_dtype="fp8", **llm_kwargs)
    else:
        fp8_llm = LLM(fp8_model or model, **({} if fp8_model else {"quantization": "fp8"}), **llm_kwargs)
    fp8_scores, fp8_greedy = scored(fp8_llm, sequences), greedy(fp8_llm)
    deltas, agree, total = [], 0, 0
    per_seq_max = []
    for ref, got in zip(ref_scores, fp8_scores):
        d = [abs(r[0] - g[0]) for r, g in zip(ref, got)]
        deltas += d
        per_seq_max.append(max(d))
        agree += sum(r[1] == g[1] for r, g in zip(ref, got))
        total += len(ref)
    passed = sum(top5_rule(a, b) for a, b in zip(ref_greedy, fp8_greedy))
    equal = sum(a.token_ids == b.token_ids for a, b in zip(ref_greedy, fp8_greedy))
    result = {"mean_abs_dlogprob": statistics.fmean(deltas), "max_abs_dlogprob": max(deltas),
              "top1_agreement": agree / total, "greedy_top5_rule": passed / len(ref_greedy),
              "greedy_equal": equal / len(ref_greedy)}
    print(f"FP8 {fp8} vs the model without FP8 (dtype auto), teacher-forced {NUM_TEACHER} x {TEACHER_LEN}: mean |dlogprob| "
          f"{result['mean_abs_dlogprob']:.4f}, max {result['max_abs_dlogprob']:.3f}, top-1 agreement "
          f"{100 * result['top1_agreement']:.1f}%; greedy {NUM_GREEDY} x {GREEDY_LEN}: top-5 rule "
          f"{passed}/{len(ref_greedy)}, identical {equal}/{len(ref_greedy)}", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--fp8-model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--fp8", choices=["weights", "kv-cache"], default="weights",
                        help="what is FP8 on the FP8 side: the weights, or the KV cache (bf16 weights)")
    args = parser.parse_args()
    if args.fp8 == "kv-cache" and args.fp8_model:
        parser.error("--fp8-model is an FP8 weights checkpoint; --fp8 kv-cache compares MODEL with an FP8 KV cache")
    run(args.model, args.fp8_model, args.fp8, device=args.device, max_model_len=args.max_model_len)


if __name__ == "__main__":
    main()

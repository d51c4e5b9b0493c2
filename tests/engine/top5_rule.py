"""The top-5 rule between two greedy runs: equal tokens, or at the first difference each side's token is among the
other side's top 5 (the runs asked for logprobs=5)."""


def assert_top5_rule(outputs, expected):
    for out, ref in zip(outputs, expected, strict=True):
        ours, theirs = out.outputs[0], ref.outputs[0]
        for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)):
            if a != b:
                assert a in theirs.logprobs[i] and b in ours.logprobs[i], (out.prompt_token_ids, i)
                break

"""The top-5 rule between two greedy runs: equal tokens, or at the first difference each side's token is among the
other side's top 5 (the runs asked for logprobs=5)."""


def top5_rule_break(out, ref) -> int | None:
    """Where the first difference between two outputs of one prompt breaks the rule; None where the rule holds."""
    ours, theirs = out.outputs[0], ref.outputs[0]
    for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)):
        if a != b:
            return None if a in theirs.logprobs[i] and b in ours.logprobs[i] else i
    return None


def assert_top5_rule(outputs, expected):
    for out, ref in zip(outputs, expected, strict=True):
        assert (i := top5_rule_break(out, ref)) is None, (out.prompt_token_ids, i)

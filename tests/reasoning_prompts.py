"""Prompts that make the default model (SmolLM2-135M-Instruct) think in <think> tags, for the reasoning tests."""

# Few-shot thinking: SmolLM2 continues it with a thought, "</think>" (written as "</", "think", ">") and an answer.
SHOTS = ("<think>\nThe sky is blue.\n</think>\nyes\n<think>\nGrass is red.\n</think>\nno\n<think>\nSnow is white.\n"
         "</think>\nyes\n<think>\n")

"""SPEED adaptation: self-distil a stock model so it keeps its quality under SPEED's visibility
rule (``vllm-accel speed-adapt``). See :mod:`.run` for the stages."""

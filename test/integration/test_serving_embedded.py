"""`scripts/serve.sh` (the README's first command) end to end, real SGLang on CPU.

The script is started once for the module as a user starts it (its own process group, only
``MEMX_PORT`` / ``MEMX_LOG_DIR`` / ``MEMX_MAX_TOTAL_TOKENS`` set): ``sglang-memx serve``
with the embedded SmolLM2-135M-Instruct (bf16) and its float32 copy (KV cell 2x) on one
CPU device and one shared memx pool, elastic KV and the host buffer on. Meanwhile a stock
SGLang server of the bf16 model (plugin filtered out, same thread count as its engine)
starts. Checked: the examples the script prints work for both models; /v1/models lists
both; both answer "Paris"; both engines are in one pool with KV cells 23,040 B and
46,080 B; greedy outputs through the router (chat, generate, frontend programs) equal
stock's; the bf16 engine's memx behaviour (status, prefix cache, no map call on the decode
path, 4xx for malformed memx requests); ``--single`` / ``--memx-disable`` still give
upstream's own command line; Ctrl-C stops everything.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_memx.models.embedded import prepare_embedded_model
from sglang_memx.serve.launcher import process_running
from support.server import LOG_DIR, READY_POLL_S, REPO, SGLangServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

NAME = "SmolLM2-135M-Instruct"
FP32 = "SmolLM2-135M-Instruct-fp32"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Water boils at"]
TOKENS = 8192  # MEMX_MAX_TOTAL_TOKENS: logical KV tokens per model
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K, V) x element bytes
KV_CELL = {NAME: 30 * 3 * 64 * 2 * 2, FP32: 30 * 3 * 64 * 2 * 4}

SERVE_FEATURES = ["--memx-elastic-kv", "--memx-host-buffer-gb", "1"]  # scripts/serve.sh's defaults
SCRIPT = REPO / "scripts" / "serve.sh"
BANNER_END = "=" * 80


def _http(url, payload=None, timeout=120.0, method=None):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = prepare_embedded_model()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}  # the script's defaults, but:
    env.update(MEMX_PORT=str(port), MEMX_LOG_DIR=str(LOG_DIR / "serve-sh"), MEMX_MAX_TOTAL_TOKENS=str(TOKENS),
               MEMX_CONFIG=str(tmp_path_factory.mktemp("serve-sh") / "models.yaml"))  # fmt: skip
    LOG_DIR.mkdir(exist_ok=True)
    log_path = LOG_DIR / "serve-sh.log"
    log = open(log_path, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    # Each engine runs on one core (the launcher splits the two); the stock server uses as many
    # threads as the bf16 engine so that greedy outputs are comparable.
    stock = SGLangServer(model, name="serve-sh-stock", stock=True, max_total_tokens=TOKENS,
                         extra_args=["--served-model-name", NAME],
                         env={"SGLANG_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"})  # fmt: skip
    stock.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while BANNER_END not in log_path.read_text(errors="replace"):
            if proc.poll() is not None:
                raise RuntimeError(f"scripts/serve.sh exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() - t0 > 900:
                raise TimeoutError(f"scripts/serve.sh printed no examples in 900 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(READY_POLL_S)
        up_s = time.monotonic() - t0
        stock.wait_ready(600)
        print(f"scripts/serve.sh printed its examples in {up_s:.1f} s; stock ready at {time.monotonic() - t0:.1f} s")
        status = _http(url + "/memx/serve")
        yield {"url": url, "proc": proc, "log": log_path, "stock": stock, "status": status, "port": port}
    finally:
        stock.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


def _engine_url(served, name):
    return served["status"]["engines"][name]["url"]


def _banner(served) -> str:
    text = served["log"].read_text(errors="replace")
    start = text.index("================ sglang-memx is serving")
    return text[start : text.index(BANNER_END, start)]


def _parallel(*calls):
    """Run the calls at once (the memx engine and the stock server have a core each); their results."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _chat(base, model, **kw):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    return client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=24, **kw)


# ---------------------------------------------------------------- the script and its examples


def test_serve_script_defaults_and_single_mode_command_lines(served, tmp_path):
    """The features default; --single / --memx-disable print upstream's own launch_server command line
    (the CPU image's second smoke test runs it); the router mode's config places both models."""
    text = SCRIPT.read_text()
    default = re.search(r'MEMX_FEATURES="\$\{MEMX_FEATURES-"([^"]*)"\}"', text)
    assert default and shlex.split(default.group(1)) == SERVE_FEATURES

    def dry(*args, **env):
        port = str(free_port())
        full = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
        full.update(MEMX_DRY_RUN="1", MEMX_PORT=port, MEMX_CONFIG=str(tmp_path / f"models-{port}.yaml"), **env)
        out = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=full, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return shlex.split(out.stdout), port

    model = str(prepare_embedded_model())
    cpu = ["--device", "cpu", "--attention-backend", "torch_native", "--cuda-graph-backend-decode", "disabled",
           "--cuda-graph-backend-prefill", "disabled"]  # fmt: skip
    argv, port = dry("--single", "--chunked-prefill-size", "256")
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    tail = ["--host", "127.0.0.1", "--port", port, *SERVE_FEATURES, "--chunked-prefill-size", "256"]
    assert argv[3:] == ["--model-path", model, "--served-model-name", NAME, *cpu, "--max-total-tokens", "16384", *tail]
    argv, port = dry("--memx-disable")
    assert argv[1:3] == ["-m", "sglang.launch_server"] and argv[-1] == "--memx-disable"
    assert not [a for a in argv if a.startswith("--memx-") and a != "--memx-disable"]

    # one flag alone (no host buffer): passed as --memx-args=VALUE, argparse once refused a lone "--memx-..."
    argv, port = dry(MEMX_FEATURES="--memx-elastic-kv")
    assert "memx_args: []" in Path(argv[5]).read_text()

    argv, port = dry("--chunked-prefill-size", "256", MEMX_MAX_TOTAL_TOKENS="4096")
    assert argv[1:4] == ["-m", "sglang_memx.cli", "serve"] and argv[4] == "--config"
    lines = subprocess.run([argv[0], "-m", "sglang_memx.cli", "serve", "--config", argv[5], "--dry-run"],
                           capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()  # fmt: skip
    specs = {d["model"]: d for d in map(json.loads, lines)}
    assert set(specs) == {NAME, FP32}
    assert len({s["pool"] for s in specs.values()}) == 1  # one shared pool
    assert {s["env"]["SGLANG_CPU_OMP_THREADS_BIND"] for s in specs.values()} == {"0", "1"}  # a core each
    for name, s in specs.items():
        a = s["argv"]
        assert a[a.index("--dtype") + 1] == ("bfloat16" if name == NAME else "float32")
        assert a[a.index("--max-total-tokens") + 1] == "4096"
        assert "--memx-elastic-kv" in a and a[a.index("--memx-host-buffer-gb") + 1] == "1"
        assert a[-2:] == ["--chunked-prefill-size", "256"]  # extra arguments go to every engine


def test_printed_examples_work_for_both_models(served):
    """Run the printed curl command of each model as printed; fetch the printed status URLs."""
    banner = _banner(served)
    url = served["url"]
    assert f"2 models on one shared memx pool ({NAME}, {FP32})" in banner
    for name in (NAME, FP32):
        section = banner[banner.index(f"--- {name} (") :]
        assert re.match(rf"--- {re.escape(name)} \(answered: \".*Paris.*\"\)", section), section[:300]
        curl = section[section.index("curl -s") : section.index("}'", section.index("curl -s")) + 2]
        out = subprocess.run(["bash", "-c", curl.replace("\\\n", " ")], capture_output=True, text=True, timeout=300)
        answer = json.loads(out.stdout)
        assert answer["model"] == name and "Paris" in answer["choices"][0]["message"]["content"], answer
        assert f"curl -s {url}/models/{name}/memx/status" in banner
        status = _http(f"{url}/models/{name}/memx/status")
        assert status["enabled"] is True
    assert f'OpenAI(base_url="{url}/v1"' in banner and f"top --router {url}" in banner


# ---------------------------------------------------------------- both models through the router


def test_models_lists_both(served):
    doc = _http(served["url"] + "/v1/models")
    assert sorted(m["id"] for m in doc["data"]) == sorted([NAME, FP32])


@pytest.mark.parametrize("name", [NAME, FP32])
def test_chat_answers_paris_and_stops(served, name):
    resp = _chat(served["url"], name)
    text = resp.choices[0].message.content
    assert "Paris" in text, text
    assert resp.choices[0].finish_reason == "stop"
    assert resp.model == name


def test_both_engines_share_one_pool_with_different_kv_cells(served):
    """The two engines are clients of one arbiter (same pool, same budget), with elastic KV, the
    shared pool and the host buffer on; the float32 model's KV cell is twice the bf16 one's."""
    ranks = {n: _http(f"{served['url']}/models/{n}/memx/status")["schedulers"][0] for n in (NAME, FP32)}
    engines = served["status"]["engines"]
    assert engines[NAME]["pool"] == engines[FP32]["pool"]
    shared = {n: r["elastic_kv"]["shared_pool"] for n, r in ranks.items()}
    assert shared[NAME]["budget_chunks"] == shared[FP32]["budget_chunks"] > 0
    assert shared[NAME]["client_id"] != shared[FP32]["client_id"]
    for name, rank in ranks.items():
        assert rank["features"] == {"status_endpoint": True, "elastic_kv": True, "shared_pool": True,
                                    "host_buffer": True, "weights": False, "peer_kv": False}, name  # fmt: skip
        assert rank["kv_pool"]["capacity_tokens"] == TOKENS and rank["kv_pool"]["layers"] == 30
        elastic = rank["elastic_kv"]
        assert elastic["group_bytes"] == elastic["group_tokens"] * KV_CELL[name]  # the model's KV cell
        assert elastic["logical_bytes"] >= TOKENS * KV_CELL[name]
    assert ranks[FP32]["kv_pool"]["dtype"] == "float32" and ranks[NAME]["kv_pool"]["dtype"] == "bfloat16"
    # The pool budget (2 GiB minus both models' weights) is the placement's.
    pool = served["status"]["devices"]["cpu0"]
    assert sorted(pool["models"]) == sorted([NAME, FP32]) and 1.0 < pool["pool_budget_gb"] < 1.3


# ---------------------------------------------------------------- the bf16 model vs stock


def test_chat_and_generate_identical_to_stock(served):
    def answers(chat_base, generate_url):
        out = [_chat(chat_base, NAME).choices[0].message.content]
        for prompt in PROMPTS:
            body = {"text": prompt, "sampling_params": {"max_new_tokens": 20, "temperature": 0}}
            out.append(_http(generate_url, body)["output_ids"])
        return out

    stock, url = served["stock"], served["url"]
    memx_side, stock_side = _parallel(
        lambda: answers(url, f"{url}/models/{NAME}/generate"), lambda: answers(stock.url, stock.url + "/generate")
    )
    assert memx_side == stock_side


def test_prefix_cache_hit_gives_same_answer(served):
    body = {"text": PROMPTS[0] + " red,", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    first = _http(f"{served['url']}/models/{NAME}/generate", body)
    again = _http(f"{served['url']}/models/{NAME}/generate", body)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == first["output_ids"]


def test_status_reports_the_embedded_model_pool(served):
    rank = _http(f"{served['url']}/models/{NAME}/memx/status")["schedulers"][0]
    pool, elastic = rank["kv_pool"], rank["elastic_kv"]
    assert pool["capacity_tokens"] == TOKENS and pool["layers"] == 30
    assert elastic["logical_bytes"] >= TOKENS * KV_CELL[NAME]  # the logical size; mapped is what is used
    assert pool["bytes"] == elastic["mapped_bytes"] <= elastic["logical_bytes"]
    assert pool["used_tokens"] + pool["available_tokens"] + pool["evictable_tokens"] == TOKENS
    assert rank["hooks"] and all(h["in_force"] for h in rank["hooks"])


def test_frontend_language_with_memx_features_on(served):
    """fork, select, regex-constrained gen and run_batch through ``RuntimeEndpoint(<router>/models/<name>)``:
    the same as stock's, compared at equal batching.

    The CPU kernels are not batch-invariant (a bf16 matmul over 2 rows rounds differently from
    one over 1), and upstream's deterministic-inference mode refuses ``torch_native`` attention,
    so the program runs one generation at a time on both sides: each fork's gen completes before
    the next one is sent, and ``run_batch`` runs its programs one after the other. Whether two
    concurrent forks landed in one batch then no longer depends on arrival timing (the router
    adds a hop that stock does not have)."""
    import sglang as sgl

    @sgl.function
    def program(s, topic):
        s += sgl.user(f"Give two facts about {topic}.")
        s += sgl.assistant_begin()
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Fact {i + 1}:" + sgl.gen("fact", max_tokens=12, temperature=0)
            f.sync()  # one generation in flight at a time (equal batching on both sides)
        s += "Facts: " + forks[0]["fact"] + forks[1]["fact"] + " Is that right? "
        s += sgl.select("verdict", choices=["yes", "no"])
        s += " Year:" + sgl.gen("year", max_tokens=6, temperature=0, regex=r" [12][0-9]{3}")
        s += sgl.assistant_end()

    def run(base):
        states = program.run_batch([{"topic": "Paris"}, {"topic": "water"}], backend=sgl.RuntimeEndpoint(base),
                                   num_threads=1)  # fmt: skip
        return [(st.text(), st["verdict"], st["year"]) for st in states]

    memx_side, stock_side = _parallel(lambda: run(f"{served['url']}/models/{NAME}"), lambda: run(served["stock"].url))
    for _, verdict, year in memx_side:
        assert verdict in ("yes", "no") and re.fullmatch(r" [12][0-9]{3}", year), (verdict, year)
    assert memx_side == stock_side


def test_steady_decode_makes_no_map_call_on_the_request_path(served):
    """The tick premaps the next decode steps' KV groups: a decode longer than a KV group maps
    nothing on the request path (every map it needed was made between iterations, counted as
    premap). On the fp32 model: its group is half the bf16 model's (256 tokens of 64 KiB chunks
    instead of 512), and its decode steps are no slower on CPU, so the decode is half as long."""
    url = f"{served['url']}/models/{FP32}"

    def counters():
        el = _http(url + "/memx/status")["schedulers"][0]["elastic_kv"]
        return el["decode_steps"], el["decode_map_calls"], el["map_calls"]["premap"], el["group_tokens"]

    steps0, maps0, _, group = counters()
    new_tokens = group + 32  # the request's KV needs more than one group, whatever its prompt
    body = {"text": "Write a long story about the sea.",
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    out = _http(url + "/generate", body, timeout=600)
    steps1, maps1, premap1, _ = counters()
    assert out["meta_info"]["completion_tokens"] == new_tokens
    assert steps1 - steps0 >= new_tokens - 10  # one decode step per token after the first
    assert maps1 - maps0 == 0 and premap1 >= 1  # the decode crossed a group boundary: mapped ahead of time


def test_malformed_requests_to_memx_get_a_4xx_never_a_5xx(served):
    """On the real engine (upstream's app and middleware, memx's routes): wrong methods, unknown
    sub-paths, bad bodies and query strings. ``test/unit/test_memx_http.py`` fuzzes the same routes."""
    engine = _engine_url(served, NAME)
    cases = [
        ("POST", "/memx/status", b"{not json", 405),
        ("PUT", "/memx/metrics", b"[]", 405),
        ("DELETE", "/memx/status", None, 405),
        ("GET", "/memx/nope", None, 404),
        ("GET", "/memx/status/x", None, 404),
        ("GET", "/memx/status?dp_rank=x&&=%ff", None, 200),
        ("GET", "/memx/status", b"\xff" * (1 << 20), 200),  # a 1 MiB body on a GET is ignored
    ]
    for method, path, body, want in cases:
        req = urllib.request.Request(engine + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                code = r.status
        except urllib.error.HTTPError as exc:
            code = exc.code
        assert code == want, (method, path, code)


# ---------------------------------------------------------------- last: stopping it


def test_ctrl_c_stops_router_engines_and_pool(served):
    """SIGINT to the script's process group (Ctrl-C in a terminal): exit 0, no engine, no arbiter left."""
    proc, status = served["proc"], served["status"]
    pids = [e["pid"] for e in status["engines"].values()]
    [(pool, pool_dir)] = {(e["pool"], e["pool_dir"]) for e in status["engines"].values()}
    arbiter = int((Path(pool_dir) / f"{pool}.pid").read_text())
    assert all(process_running(p) for p in [*pids, arbiter])
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(90) == 0
    deadline = time.monotonic() + 10
    while any(process_running(p) for p in [*pids, arbiter]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in [*pids, arbiter] if process_running(p)]
    left = subprocess.run(["pgrep", "-f", pool], capture_output=True, text=True).stdout.split()
    assert not left, left
    assert "every engine stopped" in served["log"].read_text(errors="replace")

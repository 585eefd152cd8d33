"""Latency under load: hybrid behind `transformers serve` against the plain server of the same model.

    python -m experiments.serving --concurrency 1,2,4 --requests 4 --max-tokens 256

starts each server it measures on loopback (`python -m hybrid serve FOLDER`; `transformers serve FOLDER`, and
with `--continuous-batching`), all on one served folder, so the weights are the same. For each concurrency level
N, in turn for each server (the order rotates from level to level), N clients send streaming greedy chat requests
with the openai client, each client one request after another, `--requests` requests in all. Per request: time
to first token (TTFT), total time, tokens (the server's usage count), tokens/s (tokens / total time). Reported
per server and level: p50/p95 of TTFT and of per-request tokens/s, and aggregate tokens/s (all tokens / wall time
of the level). Only the server being measured runs: the others are frozen (SIGSTOP), since an idle
continuous-batching server polls on a full core. Writes `requests.jsonl` (rerunning the same command resumes:
finished levels are kept), `summary.json`, `report.md` and `latency.png` into --out. The servers are always
stopped, also on an error or Ctrl-C; their logs are in --out/logs (hybrid's has each request's tau).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from experiments.datasets import load_prompts

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"  # loopback only: nothing outside this machine reaches the servers
SERVERS = ("hybrid", "plain", "plain-cb")
TAU = re.compile(r"tau ([0-9.]+)")  # in hybrid's per-request log line (GenerationStats.summary)


def server_command(name: str, folder: Path, device: str, port: int) -> list[str]:
    address = ["--device", device, "--host", HOST, "--port", str(port)]
    if name == "hybrid":
        return [sys.executable, "-m", "hybrid", "serve", str(folder), *address]
    plain = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder), *address]
    return plain + (["--continuous-batching"] if name == "plain-cb" else [])


class Server:
    """One server process on a free loopback port (its command's `options` after the folder's), its output in `log`,
    `env` added to its environment; `stop` ends it (and only it)."""

    def __init__(
        self,
        name: str,
        folder: Path,
        device: str,
        log: Path,
        options: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        self.name, self.log = name, log
        with socket.socket() as probe:  # a free port: bind to 0 and read what the kernel chose
            probe.bind((HOST, 0))
            self.port = probe.getsockname()[1]
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", **(env or {}))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("a")
        self.process = subprocess.Popen(
            server_command(name, folder, device, self.port) + list(options),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,  # its own process group: Ctrl-C reaches this script, which stops the server itself
        )
        self.url = f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the {self.name} server exited with code {self.process.returncode} while starting; "
                    f"the end of {self.log}:\n{tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the {self.name} server did not answer /health within {timeout:.0f} s; see {self.log}")

    def pause(self) -> None:
        """Freeze it between its levels: an idle continuous-batching server polls its queue on a full core."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.resume()  # a frozen process would not act on SIGTERM
            os.killpg(self.process.pid, signal.SIGTERM)  # its own process group: the server alone
            try:
                self.process.wait(timeout=5)  # uvicorn waits for open streams to end: not for long
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log_file.close()


def tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stream_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming greedy chat request; times from the call to the first content and to the last chunk, and the
    content chunks it came in."""
    start = time.perf_counter()
    first, tokens, text = None, None, []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},  # the usage chunk, last: transformers 5.25 sends it only when asked
    )
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
    total = time.perf_counter() - start
    if tokens is None:
        raise RuntimeError("the server's stream ended without a usage count")
    ttft = (first or time.perf_counter()) - start
    return {
        "ttft": ttft,
        "total": total,
        "tokens": tokens,
        "tokens_per_s": tokens / total,
        "text": "".join(text),
        "chunks": len(text),
    }


def run_level(server: Server, model: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int):
    """`requests` requests from `concurrency` clients, each sending its share one after another."""
    client = server_client(server)
    shares = [list(range(c, requests, concurrency)) for c in range(concurrency)]

    def client_loop(share: list[int]) -> list[dict]:
        return [
            {
                "request": i,
                "prompt": i % len(prompts),
                **stream_request(client, model, prompts[i % len(prompts)], max_tokens),
            }
            for i in share
        ]

    pool = ThreadPoolExecutor(max_workers=concurrency)
    start = time.perf_counter()
    try:
        rows = [row for part in pool.map(client_loop, shares) for row in part]
    finally:  # on Ctrl-C: do not wait for the clients here; stopping the server ends their streams
        pool.shutdown(wait=False, cancel_futures=True)
    return rows, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(rows: list[dict], levels: list[dict]) -> list[dict]:
    """Per server and concurrency: percentiles over its requests, aggregate tokens/s over its levels' wall time."""
    plain_text = {r["prompt"]: r["text"] for r in rows if r["server"] == "plain"}  # greedy: one answer per prompt
    summary = []
    for key in dict.fromkeys((level["server"], level["concurrency"]) for level in levels):
        mine = [r for r in rows if (r["server"], r["concurrency"]) == key]
        walls = [lv for lv in levels if (lv["server"], lv["concurrency"]) == key]
        taus = [t for lv in walls for t in lv.get("tau", [])]
        same = [r["text"] == plain_text[r["prompt"]] for r in mine if r["prompt"] in plain_text]
        summary.append(
            {
                "server": key[0],
                "concurrency": key[1],
                "requests": len(mine),
                "mean_tokens": float(np.mean([r["tokens"] for r in mine])),
                "ttft_p50": percentile([r["ttft"] for r in mine], 50),
                "ttft_p95": percentile([r["ttft"] for r in mine], 95),
                "tokens_per_s_p50": percentile([r["tokens_per_s"] for r in mine], 50),
                "tokens_per_s_p95": percentile([r["tokens_per_s"] for r in mine], 95),
                "aggregate_tokens_per_s": sum(r["tokens"] for r in mine) / sum(lv["wall"] for lv in walls),
                "mean_tau": float(np.mean(taus)) if taus else None,
                "same_text_as_plain": f"{sum(same)}/{len(same)}" if same else None,
            }
        )
    return summary


def markdown(summary: list[dict], settings: dict) -> str:
    lines = [
        f"# Serving latency: {settings['verifier']} with drafter {settings['drafter']}",
        "",
        f"`python -m experiments.serving {settings['command']}`",
        "",
        f"{settings['dataset']} prompts, streaming greedy chat requests of up to {settings['max_tokens']} tokens, "
        f"{settings['requests']} requests per server and concurrency level, device {settings['device']}. "
        "Per-request tokens/s = tokens / total time; p95 of TTFT is the slow tail, p95 of tokens/s the fast one.",
        "",
        "| server | concurrency | requests | tokens | TTFT p50 (s) | TTFT p95 (s) | tok/s p50 | tok/s p95 "
        "| aggregate tok/s | tau | text = plain's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        tau = f"{s['mean_tau']:.2f}" if s["mean_tau"] is not None else ""
        lines.append(
            f"| {s['server']} | {s['concurrency']} | {s['requests']} | {s['mean_tokens']:.0f} | {s['ttft_p50']:.2f} "
            f"| {s['ttft_p95']:.2f} | {s['tokens_per_s_p50']:.1f} | {s['tokens_per_s_p95']:.1f} "
            f"| {s['aggregate_tokens_per_s']:.1f} | {tau} | {s['same_text_as_plain'] or ''} |"
        )
    by_key = {(s["server"], s["concurrency"]): s for s in summary}
    ratios = []
    for (server, c), s in by_key.items():
        plain = by_key.get(("plain", c))
        if server != "plain" and plain is not None:
            ratios.append(
                f"| {server} / plain | {c} | {s['tokens_per_s_p50'] / plain['tokens_per_s_p50']:.2f}x "
                f"| {s['ttft_p50'] / plain['ttft_p50']:.2f}x "
                f"| {s['aggregate_tokens_per_s'] / plain['aggregate_tokens_per_s']:.2f}x |"
            )
    if ratios:
        lines += [
            "",
            "| ratio | concurrency | tok/s p50 | TTFT p50 | aggregate tok/s |",
            "|---|---:|---:|---:|---:|",
            *ratios,
        ]
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path) -> bool:
    from experiments import plots

    if not plots.available():
        print("matplotlib is not installed: no plot (pip install -e '.[experiments]')", file=sys.stderr)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    levels = sorted({s["concurrency"] for s in summary})
    for i, server in enumerate(dict.fromkeys(s["server"] for s in summary)):
        mine = sorted((s for s in summary if s["server"] == server), key=lambda s: s["concurrency"])
        xs = [s["concurrency"] for s in mine]
        for q, style in (("p50", "-o"), ("p95", "--x")):  # one colour per server: solid p50, dashed p95
            ttft_ax.plot(xs, [s[f"ttft_{q}"] for s in mine], style, color=f"C{i}", label=f"{server} {q}")
            speed_ax.plot(xs, [s[f"tokens_per_s_{q}"] for s in mine], style, color=f"C{i}", label=f"{server} {q}")
    for ax, label in ((ttft_ax, "time to first token (s)"), (speed_ax, "per-request tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    speed_ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def served_folder(verifier: str, drafter: str, out: Path) -> Path:
    """The folder every server loads: the embedded default's (cached), or `verifier`'s exported into `out`;
    `tiny` is the tests' tiny random Llama (for checking this command, not for figures)."""
    from hybrid.export import export_served
    from hybrid.serving import served_default

    if verifier == "default":
        return served_default(drafter)
    if verifier == "tiny":
        from experiments.models import load_tiny_model

        model, tokenizer = load_tiny_model()
        verifier = str(out / "tiny-verifier")
        model.save_pretrained(verifier)
        tokenizer.save_pretrained(verifier)
    return export_served(out / "served", verifier, drafter)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m experiments.serving", description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default="default", help="default (embedded SmolLM2), tiny, or a model folder")
    parser.add_argument("--drafter", default="default", help="hybrid's drafter (see python -m hybrid export-served)")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    parser.add_argument(
        "--dataset", default="dev", help="dev, dev-chat, mt-bench, humaneval, heldout or a .jsonl of prompts"
    )
    parser.add_argument("--concurrency", default="1,2,4", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--requests", type=int, default=4, help="requests per server and level (at least N)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds a server may take to start")
    parser.add_argument("--out", default="runs/serving", help="folder for the results; rerun to resume")
    args = parser.parse_args(argv)
    args.servers = list(dict.fromkeys(s.strip() for s in args.servers.split(",") if s.strip()))
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown or not args.servers:
        parser.error(f"--servers {unknown or 'is empty'}: choose from {', '.join(SERVERS)}")
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        parser.error(f"--concurrency {args.concurrency!r}: give whole numbers, e.g. 1,2,4")
    if not args.concurrency or args.concurrency[0] < 1:
        parser.error("--concurrency: every level must be at least 1 client")
    if args.requests < max(args.concurrency):
        parser.error(f"--requests {args.requests} < concurrency {max(args.concurrency)}: every client sends one")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    return args


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from hybrid.serving import require_serving

    require_serving()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.dataset)
    settings = {k: getattr(args, k) for k in ("verifier", "drafter", "dataset", "requests", "max_tokens", "device")}
    settings_file = out / "settings.json"
    if settings_file.exists() and json.loads(settings_file.read_text()) != settings:
        raise SystemExit(
            f"{out} holds a run with other settings ({settings_file}): pass another --out or delete that folder"
        )
    settings_file.write_text(json.dumps(settings, indent=1))
    results = out / "requests.jsonl"
    done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    rows = [r for r in done if r["kind"] == "request"]
    levels = [r for r in done if r["kind"] == "level"]
    finished = {(lv["server"], lv["concurrency"]) for lv in levels}
    # Interleaved: level by level, each server in turn, starting one server later at each level.
    plan = [
        (server, c)
        for i, c in enumerate(args.concurrency)
        for server in args.servers[i % len(args.servers) :] + args.servers[: i % len(args.servers)]
        if (server, c) not in finished
    ]
    print(f"{len(finished)} levels already measured in {out}, {len(plan)} to go", flush=True)

    # `finally` stops the servers on Ctrl-C and on kill; SIGINT is set explicitly since a shell starting this in the
    # background makes it ignore SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers: dict[str, Server] = {}
    began = time.perf_counter()
    try:
        if plan:
            folder = served_folder(args.verifier, args.drafter, out)
            for name in dict.fromkeys(server for server, _ in plan):
                servers[name] = Server(name, folder, args.device, out / "logs" / f"{name}.log")
            for name, server in servers.items():
                print(f"starting {name} on {server.url} (log {server.log})", flush=True)
                server.wait_ready(args.start_timeout)
                stream_request(server_client(server), str(folder), prompts[0], 16)  # warm-up, untimed
                server.pause()
                print(f"{name} ready and warmed up after {time.perf_counter() - began:.0f} s", flush=True)
        for step, (name, c) in enumerate(plan, 1):
            server = servers[name]
            log_start = server.log.stat().st_size
            server.resume()  # the only server running while it is measured
            level_rows, wall = run_level(server, str(folder), prompts, c, args.requests, args.max_tokens)
            server.pause()
            with server.log.open(errors="replace") as log:
                log.seek(log_start)
                taus = [float(m.group(1)) for m in TAU.finditer(log.read())]
            level = {"kind": "level", "server": name, "concurrency": c, "wall": wall, "tau": taus}
            new = [{"kind": "request", "server": name, "concurrency": c, **r} for r in level_rows]
            with results.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in [*new, level])
            rows += new
            levels.append(level)
            ttft = [r["ttft"] for r in new]
            speed = [r["tokens_per_s"] for r in new]
            print(
                f"[{step}/{len(plan)}, {time.perf_counter() - began:.0f} s] {name} x{c}: TTFT p50 {percentile(ttft, 50):.2f} s, "
                f"tok/s p50 {percentile(speed, 50):.1f}, aggregate {sum(r['tokens'] for r in new) / wall:.1f} tok/s",
                flush=True,
            )
    finally:
        if servers:
            print(f"stopping {', '.join(servers)}", flush=True)
        for server in servers.values():
            server.stop()

    summary = summarize(rows, levels)
    command = " ".join(argv)
    (out / "summary.json").write_text(json.dumps({"settings": settings, "summary": summary}, indent=1))
    report = markdown(summary, {**settings, "command": command})
    (out / "report.md").write_text(report)
    plot(summary, out / "latency.png")
    print(report)
    return summary


def server_client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=3600)


if __name__ == "__main__":
    main()

"""Whether one client of `python -m hybrid serve` can tell, by timing or by a stream's chunks, what another client
was recently given, under the default policy and under a shared store with per-step chunks.

    python -m experiments.client_isolation --out docs/results/client-isolation

For each policy it starts a server of the embedded default on loopback. For each prompt, client "alice" asks it,
then client "bob" asks the same prompt, then bob asks a prompt nobody asked (a control); every request streams,
greedy. It prints, per request, the seconds to the last token and to the first, the chunks the stream came in and
the τ the server logged. A shared store drafts bob's repeat from alice's answer (a high τ, a short time: what bob
learns); per client it drafts bob's repeat as it drafts the control. Chunks of one step's accepted tokens tell a
client each step's acceptance; 16-token chunks tell it the answer's length only. Needs the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from experiments.serving import Server, stream_request

POLICIES = {
    "shared store, per-step chunks": ("--online-store", "shared", "--stream-chunk", "1"),
    "per client, 16-token chunks (default)": (),
}
# Our own prompts (not from an evaluation set): a story a client may have asked for, and controls nobody asked.
ASKED = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a short story about a robot that learns to paint.",
    "Write a short story about two friends lost in a desert city.",
]
CONTROLS = [
    "Write a short story about a baker who opens a shop on the moon.",
    "Write a short story about a violinist who plays for a storm.",
    "Write a short story about a child who builds a boat from books.",
]
TAU = re.compile(r"default drafter: .*?tau ([0-9.]+)")


def streamed(server: Server, model: str, client: str, prompt: str, max_tokens: int) -> dict:
    """One streaming greedy request as `client` (its bearer token): seconds to the first and last content, chunks."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{server.url}/v1", api_key=client, max_retries=0, timeout=600)
    request = stream_request(api, model, prompt, max_tokens)
    taus = TAU.findall(server.log.read_text(errors="replace"))
    return {"seconds": request["total"], "ttft": request["ttft"], "chunks": request["chunks"], "tau": float(taus[-1])}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("docs/results/client-isolation"))
    args = parser.parse_args(argv)
    from hybrid.serving import served_default

    folder = served_default("default")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for policy, options in POLICIES.items():
        log = args.out / "logs" / f"{len(rows)}.log"
        log.unlink(missing_ok=True)
        server = Server("hybrid", folder, "cpu", log, options=options)
        try:
            server.wait_ready(900)
            streamed(server, str(folder), "warm-up", "Say hello.", 8)  # the first request's own costs are not a store's
            for asked, control in zip(ASKED, CONTROLS):
                for who, client, prompt in (("alice asks", "alice", asked), ("bob repeats", "bob", asked)):
                    rows.append(
                        {
                            "policy": policy,
                            "request": who,
                            **streamed(server, str(folder), client, prompt, args.max_tokens),
                        }
                    )
                rows.append(
                    {
                        "policy": policy,
                        "request": "bob, control",
                        **streamed(server, str(folder), "bob", control, args.max_tokens),
                    }
                )
                print(*(json.dumps(row) for row in rows[-3:]), sep="\n", flush=True)
        finally:
            server.stop()
    table = ["| policy | request | seconds (mean) | TTFT s | chunks | τ |", "|---|---|---:|---:|---:|---:|"]
    for policy in POLICIES:
        for request in ("alice asks", "bob repeats", "bob, control"):
            group = [r for r in rows if r["policy"] == policy and r["request"] == request]
            mean = {k: sum(r[k] for r in group) / len(group) for k in ("seconds", "ttft", "chunks", "tau")}
            table.append(
                f"| {policy} | {request} | {mean['seconds']:.2f} | {mean['ttft']:.2f} | {mean['chunks']:.1f} | "
                f"{mean['tau']:.2f} |"
            )
    text = "\n".join(table)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


if __name__ == "__main__":
    main()

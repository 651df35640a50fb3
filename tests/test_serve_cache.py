"""Issue #4 through Ray Serve's gRPC proxy, with real Ray, real Redis and the real model:
cache-aware routing keeps multi-turn chats on the replica holding their history, and the
cache manager's Redis index matches what the workers hold."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from cache_manager import actor as cache_manager
from cluster.cache_check import find_problems
from kvserve.v1 import generation_pb2 as pb
from tests.serving import APP, METADATA, serve_locally

MANAGER_KEY = cache_manager.deployment_key(APP, "Generation")
PLACES = ["Lisbon", "Oslo", "Quito", "Hanoi", "Accra", "Perth", "Lima", "Riga"]


def document(i: int) -> str:
    place = PLACES[i]
    lines = [f"Entry {j} of the {place} harbour log: ship {100 * i + j} arrived at berth "
             f"{j % 7 + 1} carrying {12 * j + i} crates of {['tea', 'salt', 'wool'][j % 3]}."
             for j in range(16)]
    return f"You answer questions about the {place} harbour log below.\n" + "\n".join(lines)


def chat_turn(stub, doc: str, history: list, question: str) -> tuple[str, pb.Usage]:
    messages = [pb.ChatMessage(role="system", content=doc), *history,
                pb.ChatMessage(role="user", content=question)]
    request = pb.GenerateRequest(messages=pb.ChatMessages(messages=messages),
                                 params=pb.SamplingParams(temperature=0, max_tokens=8))
    responses = list(stub.Generate(request, metadata=METADATA))
    return "".join(r.text for r in responses), responses[-1].usage


def conversations(stub, count: int = 8, turns: int = 5) -> list[list[pb.Usage]]:
    """`count` chats advancing in rounds: each round sends every chat's next turn at once.
    (Chats that each wait for their own previous turn would stick to one replica under plain
    least-loaded routing too: the replica that just answered is the less loaded one.)"""
    histories: list[list] = [[] for _ in range(count)]
    usages: list[list[pb.Usage]] = [[] for _ in range(count)]

    def turn(i: int, t: int) -> None:
        question = f"Question {t}: which ship arrived at berth {t + 1}?"
        answer, usage = chat_turn(stub, document(i), histories[i], question)
        usages[i].append(usage)
        histories[i] += [pb.ChatMessage(role="user", content=question),
                         pb.ChatMessage(role="assistant", content=answer)]

    with ThreadPoolExecutor(count) as pool:
        for t in range(turns):
            list(pool.map(lambda i, t=t: turn(i, t), range(count)))
    return usages


def cache_check(served) -> list[str]:
    """What `kvserve cache check` prints: every difference between Redis and the workers."""
    return find_problems(served.handle, cache_manager.get(MANAGER_KEY))


def test_multi_turn_chats_stay_on_the_replica_holding_their_history():
    """Acceptance 4: 8 conversations x 5 turns over 2 replicas; every later turn finds its
    history cached (so it was routed to its holder) and turns 2-5 hit > 90% of prompt tokens."""
    app = {"replicas": 2, "kv_cache_memory": "256MiB", "num_cpus_per_replica": 1}
    with serve_locally(app) as served:
        chats = conversations(served.stub)
        later = [u for usages in chats for u in usages[1:]]
        for i, usages in enumerate(chats):
            for turn, usage in enumerate(usages[1:], start=2):
                assert usage.cached_tokens > 0.8 * usage.prompt_tokens, (i, turn, usage)
        rate = sum(u.cached_tokens for u in later) / sum(u.prompt_tokens for u in later)
        assert rate > 0.9, rate
        assert cache_check(served) == []

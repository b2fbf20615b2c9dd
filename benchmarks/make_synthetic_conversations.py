"""Write the synthetic conversation set `trtopt bench serve --dataset conversations` uses (ShareGPT format, no download).

Deterministic (fixed seed): 200 two-turn conversations whose prompt and reply lengths spread like a chat workload
(short questions and long ones with pasted context; replies from one sentence to several paragraphs). The text is
made from templates, so it reads like English without being anyone's data; only its token counts matter to the
benchmark (the reply's length sets max_tokens).

    python benchmarks/make_synthetic_conversations.py  # -> trtopt/serving/data/synthetic_conversations.json
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "trtopt" / "serving" / "data" / "synthetic_conversations.json"

TOPICS = ["photosynthesis", "the French revolution", "binary search", "compound interest", "sourdough bread",
          "plate tectonics", "the immune system", "jazz harmony", "garbage collection", "supply and demand",
          "black holes", "the Roman aqueducts", "vaccines", "public key cryptography", "coral reefs",
          "the printing press", "neural networks", "tides", "inflation", "composting", "the water cycle",
          "relational databases", "sleep", "volcanoes", "the Silk Road", "electric motors", "chess openings",
          "climate models", "the human heart", "version control"]
ASKS = ["Can you explain {t} to a beginner?", "What are the most common misconceptions about {t}?",
        "Write a short summary of {t}.", "How would you teach {t} to a ten-year-old?",
        "Give me three facts about {t}.", "Compare {t} with {u}.", "What is the history of {t}?",
        "Why does {t} matter today?", "List the key terms someone should know about {t}.",
        "I read this and got confused: \"{ctx}\" What does it mean for {t}?"]
OPENERS = ["Sure.", "Good question.", "Here is an overview.", "Let me break it down.", "Happy to help."]
SENTENCES = ["{T} is often described in terms of a few simple ideas that build on each other.",
             "The first thing to notice about {t} is how it connects cause and effect.",
             "Historically, people understood {t} only in part, and the full picture came later.",
             "A useful analogy compares {t} with everyday experience, although every analogy has limits.",
             "Experts still debate some details of {t}, but the core is well established.",
             "In practice, {t} shows up in places most people would not expect.",
             "One common mistake is to treat {t} as a single mechanism when it is really several.",
             "If you remember one thing, remember that {t} depends on the conditions around it.",
             "Measurements of {t} have improved a lot with better instruments and more data.",
             "The relation between {t} and {u} is a good example of how fields borrow ideas."]


def conversation(rng: random.Random) -> dict:
    t, u = rng.sample(TOPICS, 2)
    ctx = " ".join(rng.choice(SENTENCES).format(t=t, T=t.capitalize(), u=u) for _ in range(rng.choice([1, 2, 4, 8])))
    ask = rng.choice(ASKS).format(t=t, u=u, ctx=ctx)
    # Reply lengths: mostly short or medium, a long tail (like real chat logs).
    n = min(40, max(1, int(rng.lognormvariate(1.6, 0.7))))
    reply = rng.choice(OPENERS) + " " + " ".join(rng.choice(SENTENCES).format(t=t, T=t.capitalize(), u=u) for _ in range(n))
    return {"id": f"synthetic-{rng.getrandbits(32):08x}",
            "conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": reply}]}


def main() -> None:
    rng = random.Random(20261123)
    data = [conversation(rng) for _ in range(200)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {len(data)} conversations to {OUT}")


if __name__ == "__main__":
    main()

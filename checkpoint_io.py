"""Hugging Face checkpoint files and the offline tokenizer: the formats on disk, none of the model.

- `read_safetensors(path)`: every tensor of a checkpoint dir (one file or shards) by its HF name;
  `hf_to_ours(name)` maps such a name to the parameter name in model.Transformer;
- `read_config_json(path)`, `check_weights(path)`: the checks a job runs before it writes anything;
- `save(model, tokenizer, path)`: an HF-format dir that model.load() and transformers both read;
- `build_tokenizer()`: a byte-level BPE trained on embedded text, with a ChatML template, no network.

model.py builds the network from these (`load`, `read_config`, `tiny`, the SmolLM2 conversion) and
re-exports `save` and `build_tokenizer`, so `model.save(...)` still works. This module imports no
other module of the project: model.py imports it, never the other way round.
"""

import json
from pathlib import Path


# ----------------------------------------------------------------------------- reading a checkpoint dir

def hf_to_ours(name: str):
    """Map a checkpoint tensor name to ours (None: a tensor we deliberately skip)."""
    if name.startswith(("mtp.", "model.visual.", "visual.")) or name.endswith("rotary_emb.inv_freq"):
        return None  # Qwen3.5's multi-token-prediction head and vision tower; stale rope buffers
    for prefix in ("model.language_model.", "model."):  # multimodal Qwen3.5 nests the text model
        if name.startswith(prefix):
            return name[len(prefix):]
    return name  # lm_head.weight


def read_safetensors(path: Path) -> dict:
    """All tensors of a checkpoint dir by their HF names: model.safetensors, or the shards its index names."""
    from safetensors.torch import load_file
    index = path / "model.safetensors.index.json"
    if index.exists():  # sharded: the index maps each tensor to its shard file
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} has no weights: expected model.safetensors or model.safetensors.index.json")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(path / f)))
        except Exception as e:  # noqa: BLE001 - a missing shard, a truncated or foreign file: one line
            raise ValueError(f"cannot read weights {path / f} ({type(e).__name__}: {e})") from None
    return tensors


def read_config_json(path) -> dict:
    """The config.json of a Hugging Face checkpoint dir as a dict: a one-line ValueError that names the
    path when the dir, the file or a JSON object is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model dir {path} does not exist")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{path} is not a Hugging Face checkpoint dir: config.json is missing")
    try:
        d = json.loads(cfg.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{cfg} must hold a JSON object, got {type(d).__name__}")
    return d


def check_weights(path) -> None:
    """A one-line ValueError unless the dir holds weights (model.safetensors or a shard index)."""
    path = Path(path)
    if not ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
        raise ValueError(f"{path} has no weights: expected model.safetensors or model.safetensors.index.json")


# ----------------------------------------------------------------------------- writing one

def save(model, tokenizer, path) -> None:
    """Write an HF-format dir (config.json + model.safetensors + tokenizer) that model.load() and transformers
    read. model: a model.Transformer (it needs .config.to_hf(), .state_dict() and .embed_tokens)."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf()
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if config.get(key) is None:
                config[key] = getattr(tokenizer, key, None)
    config["dtype"] = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {("model." + n if not n.startswith("lm_head") else n): p.detach().contiguous().cpu()
             for n, p in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # shared with embed_tokens; safetensors refuses aliased tensors
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


# ----------------------------------------------------------------------------- the offline tokenizer

CHAT_TEMPLATE = (  # ChatML, as Qwen uses it
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The merges of the tiny tokenizer are learned from this text: enough English, markdown memory notes
# and agent actions that common words become single tokens. Any byte string still encodes (byte fallback).
TOKENIZER_TEXT = """\
You are an agent. Solve the task step by step, then reply with exactly one action.
Think about what you know, write your reasoning, and use the memory of what you have learned so far.
<action>ls -la</action> <action>cat .agent_memory/NOTES.md</action> <action>python -m pytest -x -q</action>
<action>search[red running shoes size 9]</action> <action>click[buy now]</action> <action>buy</action>
<action>open[3]</action> <action>answer[Paris]</action> <action>run train.py</action> <action>evaluate</action>
<action>put stone 1 in potion 2</action> <action>put stone 0 in cauldron</action> <action>end trial</action>
### Repository Knowledge
- The tests live in tests/ and run with pytest; the package code is in src/.
- A small blue pointy stone (value +1) turns large when the red potion is applied.
### Lessons & Pitfalls
- Check the file before editing it; run the failing test first, then the whole suite.
- Do not repeat an action that already failed; read the error message and the traceback.
Observation: the command returned exit code 0. The output was empty. 12 of 40 turns remaining.
Reward 1.0. The task is solved. The hidden tests pass. The patch applies cleanly.
def main(args):\n    for i in range(10):\n        print(i, args)\n    return None\n
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.
Memory is a markdown file of notes. The writer rewrites the memory after each task so that the next task goes better.
The actor reads the memory, runs commands in the shell, looks at the output and decides what to do next.
Good notes are specific: the name of the function that failed, the file where the bug was, the command that worked.
Alchemy: each potion moves a stone along one axis of the cube; the best stone is worth fifteen points, put it in the cauldron.
Shop: search for the product, open the item, choose the size and the colour, check the price, then buy it.
Research: search the documents, open the best result, read the passage and answer the question with a short phrase.
Coding: reproduce the bug, find the function, edit the file, run the tests again and make sure nothing else broke.
error: file not found. Traceback (most recent call last): AssertionError: expected 3, got 4. FAILED tests/test_core.py::test_retry
import os, sys, json; from pathlib import Path; with open(path) as f: data = json.load(f); print(len(data))
git diff; git status; grep -rn "def export" src/; sed -n 1,40p src/tablib/core.py; pip install -e .; echo done
Today we learned three things. First, read the instructions. Second, test every change. Third, write down what worked.
The score of a task is between zero and one. A higher score means a better answer, a faster fix or a cheaper purchase.
I will now check the configuration, compare the results, and report the numbers in a table with one row per model.
"""


def build_tokenizer(vocab_size: int = 1024, extra_text: str = ""):
    """Byte-level BPE trained deterministically on TOKENIZER_TEXT (+ extra_text, e.g. a domain's
    observations, so they take fewer tokens), with ChatML specials; no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT] * 4 + ([extra_text] if extra_text else []), trainer=trainer)
    return chat_tokenizer(tok)


def chat_tokenizer(tok):
    """A trained `tokenizers.Tokenizer` (build_tokenizer's, or one read back from its JSON) as the
    transformers tokenizer the models use: ChatML specials and chat template."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=4096)

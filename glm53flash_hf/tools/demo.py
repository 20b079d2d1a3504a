"""``glm53flash-demo``: load the embedded default checkpoint as a new user would and run it on real inputs.

1. Makes the embedded tiny checkpoint ``./glm53flash-tiny`` when ``--model`` is left at that default and the folder
   is absent; any other ``--model`` must be a checkpoint folder (with a ``config.json``).
2. Loads it through ``AutoProcessor`` and ``AutoModelForImageTextToText`` with ``trust_remote_code=True``.
3. Packs three passages of ``pydoc_data.topics`` into one row, runs a forward and backward pass with labels, and
   checks that the middle passage gives the same logits as when run alone.
4. Runs the model on a chat turn with scikit-image's astronaut photo.

Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

DEFAULT_MODEL = "glm53flash-tiny"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"checkpoint folder (default: ./{DEFAULT_MODEL}, made with glm53flash-make-tiny when "
                             "absent; any other path must hold a checkpoint)")
    parser.add_argument("--length", type=int, default=96, help="tokens taken from each of the three passages")
    args = parser.parse_args(argv)
    if args.length < 1:
        parser.error(f"--length must be >= 1; got {args.length}")
    has_checkpoint = os.path.isfile(os.path.join(args.model, "config.json"))
    if not has_checkpoint and args.model != DEFAULT_MODEL:
        what = "does not exist" if not os.path.exists(args.model) else "holds no config.json"
        parser.error(f"--model {args.model!r} {what}: pass a checkpoint folder, or leave --model out for the "
                     f"embedded tiny checkpoint ./{DEFAULT_MODEL}")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if not has_checkpoint:
        from .make_tiny import make_tiny

        print(f"making the embedded tiny checkpoint in {args.model} ...")
        make_tiny(args.model, show_progress=False)
    processor = AutoProcessor.from_pretrained(args.model, trust_remote_code=True)
    model = AutoModelForImageTextToText.from_pretrained(args.model, trust_remote_code=True, dtype=torch.float32)
    text_config = model.config.get_text_config()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"loaded {type(model).__name__} from {args.model} (remote code): {n_params / 1e6:.2f} M parameters, "
          f"layers: {', '.join(text_config.layer_types)} + {text_config.num_nextn_predict_layers} MTP")

    from pydoc_data.topics import topics

    tokenizer = processor.tokenizer
    docs = [torch.tensor(tokenizer(topics[name]).input_ids[: args.length]) for name in sorted(topics)[:3]]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor([0] + [len(d) for d in docs[:-1]]), 0)] = -100
    model.train()
    start = time.perf_counter()
    out = model(input_ids=ids, position_ids=pos, labels=labels)
    out.loss.backward()
    elapsed = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        alone = model(input_ids=docs[1][None]).logits[0]
        packed = model(input_ids=ids, position_ids=pos).logits[0, len(docs[0]) : len(docs[0]) + len(docs[1])]
    diff = (packed - alone).abs().max().item()
    print(f"packed row of {ids.shape[1]} tokens (3 passages of pydoc_data.topics): loss {out.loss.item():.4f}, "
          f"forward+backward {elapsed:.2f} s")
    print(f"packed vs alone (passage 2): max |Δlogit| = {diff:.2e}")

    import skimage.data
    from PIL import Image

    image = Image.fromarray(skimage.data.astronaut()).resize((112, 112))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    n_image = int((inputs["mm_token_type_ids"] == 1).sum())
    print(f"image chat: {inputs['input_ids'].shape[1]} tokens ({n_image} image placeholders), "
          f"next-token logits finite: {bool(torch.isfinite(logits[0, -1]).all())}")
    print(f"prompt: {prompt!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Hugging Face Trainer: a tiny GPT-2 built from a config (no download), CPU and gloo, or the GPU and nccl
(``FW_DEVICE``, via Accelerate)."""

import os
import tempfile

import fwcommon  # first: offline hub, step count
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

fwcommon.deterministic()
set_seed(0)
config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0)
model = GPT2LMHeadModel(config)
generator = torch.Generator().manual_seed(1234)
tokens = torch.randint(0, 128, (64, 16), generator=generator)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": tokens[i], "labels": tokens[i]}


with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(
        output_dir=out,
        max_steps=fwcommon.STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=fwcommon.DEVICE_TYPE == "cpu",
        ddp_backend=fwcommon.BACKEND,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        data_seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
fwcommon.report(model.named_parameters(), int(os.environ.get("RANK", "0")))

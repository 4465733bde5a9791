"""The trainers: `MemFitTrainer` and its arguments, the TRL and Seq2Seq pairs, and the recipes' runner.

They plan before `Trainer.__init__`, apply the plan to the arguments, check it against measured memory and
recover from an out-of-memory error. They need transformers and torch, TRL for `trl`; `hf_memfit` loads
them on first use.
"""

"""Training MTP / EAGLE-1 / EAGLE-3 draft heads for the runtime in infer/ (the head trained is infer's own module).

One job per file:
  config.py        the typed schema of conf/config.yaml (types and ranges checked once, at start)
  target.py        the target's config and its frozen shared tensors (embedding, lm_head, final norm), read by name
  heads.py         the head from conf/head (mtp | eagle1 | eagle3, norm switches) and its documented initialisation
  draft_vocab.py   an EAGLE-3 head's draft vocabulary: target probability mass (or frequency) on the features
  data.py          micro batches of precomputed features, the train/eval split, the chain windows
  losses.py        the target's distribution once per micro batch; chunked KL / CE (fused with lm_head); SmoothL1
  ttt.py           training-time test: the unroll's attention, the prefix's step-0 keys plus the chain's own
  unroll.py        the unroll's index plan (the shift), once per micro batch; the training forward: the head applied
                   K times on its own hidden states; per-step statistics
  distributed.py   everything DeepSpeed: process group, the ZeRO-wrapped head, its checkpoints, gathering
  checkpoint.py    resume: DeepSpeed's folder guarded by the run's JSON identity
  trainer.py       the components composed: the step, evaluation, validation, the run, the exported head
  metrics.py       tqdm, metrics.jsonl, wandb
  train.py         the Hydra entry point (conf/config.yaml)
  torchrun.py      torchrun's agent for launch/train.sh: one-line user errors, signals reach every worker
  run_lock.py      one run per output folder
  memory_plan.py   parameter counts and memory per GPU of any config, without weights
  measure_step.py  peak memory of one real-shaped training step (random weights)
  validate.py      the head served by infer/: conditional acceptance, tau, speedup, the trainer's figures on the same
                   text (also called by the trainer)
  report.py        a validation report's table, report.json and plots
  plots.py         PNG plots of acceptance, accepted lengths and training curves
  export.py        the head in the runtime, SGLang NextN and EAGLE layouts, and back
"""

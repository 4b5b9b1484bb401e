"""Checkpoints that are whole or absent: written to staging, verified, renamed, then reported.

layout (names, format, errors), files (hashing, durable writes), identity (what a resume must
share: settings, global batch, model), rng, ranks (the collectives), record (Ray Train's record
of the reported checkpoints), verify (finding, checking against the manifest), damaged (stepping
back past damaged checkpoints), save, load, universal (conversion for another worker count).

One checkpoint is a directory in the run directory, registered with Ray Train:

    checkpoint_000100/
      manifest.json      step, world size, data position, config hash, size + sha256 of every file
      ds/zero_pp_rank_{r}_mp_rank_00_model_states.pt        rank r's ZeRO-3 model-state shard
      ds/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt   rank r's fp32 master weights + Adam moments
      rng/rank{r}.pt     rank r's torch / numpy / python RNG state, as tensors and plain values
                         (read with torch.load(weights_only=True): no pickle of ours runs code)

Saving (save.save_and_report; every rank calls it at the same steps):

1. rank 0 empties `<run dir>/.staging/`; barrier.
2. every rank writes its DeepSpeed shard and RNG state into `.staging/checkpoint_000100/`,
   fsyncs and hashes its own files (the ranks hash in parallel; each node flushes what it wrote).
3. rank 0 gathers the file lists, checks that every rank's model and optimizer shards and RNG
   file are there with the size their writer saw (which also proves the storage is shared),
   fsyncs what else DeepSpeed left there and every directory, writes manifest.json last (so it
   never vouches for a file still in a cache) and renames the directory to `checkpoint_000100`.
4. rank 0 broadcasts success or its error; every rank then reports the directory to Ray Train
   where it lies (CheckpointUploadMode.NO_UPLOAD: nothing is copied), or raises that error.

A crash before step 4 leaves Ray's latest checkpoint as it was: a staging directory is never
reported (the next save clears it), and a renamed but unreported directory is not in Ray's
snapshot, so neither Ray nor the driver resumes from it. A rank that fails to write (storage
full or read-only) raises at once with the reason; Ray then ends the attempt.

Loading (load.load_into) takes the directory damaged.choose_checkpoint settled on, checks it against its
manifest, and loads it with an explicit DeepSpeed tag: DeepSpeed's `latest` file is never written
or read.

A damaged checkpoint (a file missing, of another size, or not matching its sha256) does not stop
the run: the driver (sizes, before Ray starts: `newest_verified`) and the workers (each rank's own
files hashed, one collective to agree: `choose_checkpoint`) step back to the newest checkpoint
Ray Train recorded that verifies. The damaged one is renamed `checkpoint_000100.damaged-<why>`
(nothing deleted; Ray Train neither hands it back nor deletes it), one line names it and why, and
a later save at its step takes a fresh name (`free_checkpoint_name`). When none verifies the run
fails naming them all.

DeepSpeed's shards are pickles that DeepSpeed itself loads whole (torch.load, weights_only off):
load checkpoints only from storage you trust (docs/checkpoints.md, "Checkpoints and trust").

Resuming on another number of workers (a lost node, a bigger cluster) keeps the global batch
(`batch_conflict`): the driver first converts the checkpoint, once, into DeepSpeed's universal
format (`to_universal`: `universal/` beside `ds/`, one file per parameter and state, no
partitioning), which every rank of the new layout then slices its own partition from.
"""

"""megatron-searchr1: Search-R1 style agentic RL (PPO / GRPO with a search engine in the loop) on Megatron-core,
torchrun-native (no Ray): every rank runs the same program.

The package, from the bottom up (each layer builds on those listed before it):
  config/             the run's dataclass sections (data, model, parallel, rollout, retrieval, algo, optim, trainer,
                      logging), YAML + dotted overrides, every field checked before anything heavy loads;
  data/ reward/ search/   prompts and parquet rows, chat templates and SFT data; the rule rewards (EM on the
                      response alone); the retrieval server (BM25, dense faiss, hybrid), its index builder and client;
  models/             Megatron GPT models (and the critic's value head) from HF configs, the HF <-> Megatron mapping
                      per family, checkpoint conversion, LoRA adapters;
  megatron/           start-up on CPU (gloo) or GPU (NCCL), token-budget micro-batches and the forward/backward
                      schedule that computes log-probs, values and updates over them;
  algo/               pure tensor functions: advantages (GRPO, GAE, RLOO, REINFORCE++), policy / value losses
                      (PPO, GSPO, CISPO), KL, DAPO's pieces, rollout correction, LLDS;
  rollout/            the multi-turn search loop over a generation engine (vLLM, or a transformers reference
                      engine) and the weight sync from the actor into it;
  trainer/            the roles (Policy: actor, and frozen, the reference; Critic; RolloutWorker: engine, retrieval
                      client, sleep / wake), every loss callback (losses.py), the RL step (rl.py) and the SFT loop;
  shared leaves       checkpoint/ (atomic save / resume, optimizer layouts, disk space), collectives.py,
                      metrics.py, console.py, plots.py, cli.py (argument parsing, one-line errors), interrupt.py
                      (Ctrl-C: one line per rank), processes.py (a child process that dies with its parent),
                      field_docs.py (config fields' one-line docs, for --help);
  entry points        train.py, sft.py, evaluate.py, infer.py, plan.py (the memory planner), demo.py: parse the
                      command line (before torch loads), build, run.

One RL step (`trainer.rl.Trainer.step`):
  1. this DP rank's prompts, each repeated `rollout.n` times under its group id;
  2. weight sync actor -> rollout engine (TP gather, PP broadcast, HF names, in buckets);
  3. rollout: the multi-turn loop generates until `</search>`, asks the retrieval server, appends
     `<information>...</information>`, and goes on until `</answer>` or `rollout.max_turns`;
  4. the engine sleeps (frees its memory) while the trainer runs: in this colocated placement generation and
     training take turns (`parallel.rollout_placement=disaggregated`, trainer/async_rl.py, overlaps them on
     ranks of their own, a batch at most `rollout.max_staleness` + 1 updates behind);
  5. reward (EM on the response), old and reference log-probs, critic values (Megatron forward passes);
  6. advantages, critic update, actor update (PPO clip; KL as a loss or in the reward); retrieved tokens are
     masked in every token-level quantity;
  7. metrics to TensorBoard and the console, sampled trajectories to JSONL, checkpoints, validation.
"""

__version__ = "0.1.0"

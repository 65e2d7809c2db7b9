"""plait: GRPO fine-tuning of language models, from one CPU to many nodes.

The package is built in floors: a module imports only from its own floor and the ones below,
lazy imports inside functions included, so a lower floor can be read, tested and reused without
the ones above it. tests/unit/test_layout.py reads the table below and checks every import;
it also refuses import cycles and imports of another module's `_private` names.

  floor  modules                               what they are
  9      cli  __main__                         the commands
  8      cluster/                              launchers: Ray placement groups and actors
  7      train/  report  diff  compare         the loop, backends, setup; the report; runs compared
  6      telemetry/                            timers, MFU, sinks, advice
  5      config/  data/                        checked config; prompt sources
  4      rollout/                              engines, replicas, the rollout server
  3      rewards/  programs/  evaluate  _reward_worker   rewards (registry, runner, built-ins); rollout programs and
                                                environments (the tool loop, trl_env, OpenEnv, rollout_func, agents)
  2      sandbox/  checkpoint                  fail-closed execution; atomic save/load
  1      algo/  models  plan  types  comm  imports  auth   pure functions, the data contract, collectives, user code by
                                                name, the bearer token
"""

__version__ = "0.1.0"

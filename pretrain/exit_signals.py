"""What a preempted run stops on and how it exits: the constants that the config check
(`train.exit_signals`), the launcher (`parallel/torchrun.py`) and the trainer
(`pretrain.training.preemption`, where the behaviour is described) share. Kept at the bottom layer
so that the config and the launcher need not import the training package.
"""

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL of sysexits.h: "try again later"
EXIT_SIGNAL_CHOICES = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGCONT", "SIGXCPU")

"""Stage 4, ``mt-train``. ``recipe`` is the training run read top to bottom (setup, loop,
validation, checkpoints, finish); ``update`` one optimiser update; ``schedule`` the Noam rate
and its cool-down; ``validation`` loss and BLEU on the valid split; ``state`` everything a
resumed run needs (one home for run state); ``snapshots`` the checkpoints, their averages;
``ema`` a moving average of the weights; ``tracking`` metrics.jsonl and TensorBoard;
``lock``, ``preempt`` and ``progress`` keep a run safe, stoppable and visible."""

"""Built-in training tasks; `train.task` names one as `module:function` (see node/task.py)."""

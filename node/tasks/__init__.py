"""Built-in training tasks; `train.task` names one as `module:function` (see node/worker/task.py).

    stdlib_lm.py      make_task -> StdlibLMTask: the default `stdlib-lm`, a byte-level transformer
                      (ByteTransformer) on the Python standard library's sources (Corpus, WindowStream)
    hf_causal_lm.py   make_task -> HFCausalLMTask: `hf-causal-lm`, a Hugging Face `transformers` causal LM
                      on local text files (HFOptions); needs the `hf` extra

Both modules import torch (and the second transformers), so nothing is imported here: load a task with
`node.worker.task.load_task`.
"""

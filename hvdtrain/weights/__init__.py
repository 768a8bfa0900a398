"""A model's weights in and out of hvdtrain, in formats other programs read.

    export.py              the trained model as safetensors, loadable without hvdtrain
    hf_export.py           a Hugging Face model as a directory from_pretrained loads, streamed from the ranks
    safetensors_stream.py  a safetensors file written one tensor at a time as the tensors arrive
    pretrained.py          a Hugging Face weights directory as a tensor source: each rank reads only what it keeps

May import common/ and checkpoint/ (its errors, the tensor source contract); nothing above.
"""

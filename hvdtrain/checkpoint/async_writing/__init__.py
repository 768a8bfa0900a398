"""train.checkpoint_async: a save returns once the state is copied, a thread writes it.

    snapshot.py    the state copied to host memory, into buffers reused from save to save
    background.py  the one write in flight, its outcome kept for the next save to agree on
"""

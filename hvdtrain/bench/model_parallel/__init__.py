"""``hvdtrain bench model-parallel``: the pipeline's bubble, the tensor group's all-reduce share and
the bytes per rank (driver.py; the measuring job: worker.py)."""

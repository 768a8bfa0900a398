"""Reading back what an offline W&B run wrote (train.loggers=[wandb])."""
import struct


def wandb_records(path):
    """The records of an offline W&B run file (run-<id>.wandb), decoded with W&B's own protobuf schema.
    W&B >= 0.19 writes it from its Go core and ships no Python reader; the container is LevelDB's log
    format (32 KiB blocks, each record cut into chunks with a 7-byte header: CRC, length, type) after a
    7-byte W&B header, as W&B's own former reader (wandb.sdk.internal.datastore) read it."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B run file"
    position, pending, block = 7, b"", 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _crc, length, chunk_type = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if chunk_type == 0:  # zero padding to the block's end
            position += (block - position % block) % block
            continue
        pending = chunk if chunk_type in (1, 2) else pending + chunk  # full/first, or middle/last
        if chunk_type in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record

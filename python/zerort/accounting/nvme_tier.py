"""The NVMe tier's shape as the memory estimate sees it (zerort.accounting.memory)."""
import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class NvmeTier:
    """The nvme tier of the optimizer state (offload_optimizer.device "nvme"; See Note [state
    tiers], runtime/engine_tiers.cpp, and Note [NVMe state store]): master, m and v in a file of
    chunk records; in RAM only the pool (buffer_count records) and, at stage 3, each unit's
    low-precision shard, or with params (offload_param.device "nvme") a second file of those
    shards and two staging buffers of the largest (Note [RegionFile]). gradients: the FP32
    gradient shard in the state file too (Note [gradient in the file]): in RAM then only the
    reduce scratch of the largest bucket's shard, a gradient slot per pool buffer and two
    staging pieces of chunk_numel rounded up to 2**16 elements. alignment: the
    directory's direct-I/O alignment in bytes, which the chunk's element count and each
    shard's bytes are rounded up to a multiple of (4096 on common filesystems). ram_fraction:
    the split (offload_optimizer.ram_fraction): the first floor(ram_fraction x chunks) records
    kept in RAM, out of the file (C++ Note [NVMe state store])."""
    buffer_count: int = 4
    chunk_numel: int = 1 << 20
    alignment: int = 4096
    params: bool = False
    gradients: bool = False
    ram_fraction: float = 0.0

    @classmethod
    def of(cls, config):
        """The Config's nvme tier, or None when the states stay in memory."""
        o = config.offload.optimizer
        return cls(o.buffer_count, o.chunk_numel, params=config.offload.param.device == "nvme",
                   gradients=o.gradient_in_file, ram_fraction=o.ram_fraction) if o.device == "nvme" else None

    def aligned(self, n):
        return -(-n // self.alignment) * self.alignment

    def record_bytes(self, state_bytes):
        return self.aligned(self.chunk_numel) * (4 + 2 * state_bytes)

    def pool_bytes(self, state_bytes):
        slot, piece = 4 * self.aligned(self.chunk_numel), 4 * -(-self.aligned(self.chunk_numel) // 2 ** 16) * 2 ** 16
        record = self.record_bytes(state_bytes)
        return self.buffer_count * (record + slot) + 2 * piece if self.gradients else self.buffer_count * record

    def chunks(self, state_numel):
        return -(-state_numel // self.aligned(self.chunk_numel))

    def ram_chunks(self, state_numel):
        """The records kept in RAM: floor(ram_fraction x chunks), as the store counts them."""
        chunks = self.chunks(state_numel)
        return min(chunks, math.floor(self.ram_fraction * chunks))

    def ram_elements(self, state_numel):
        """Elements of master, m and v (each) in the RAM records, their padding included."""
        return self.ram_chunks(state_numel) * self.aligned(self.chunk_numel)

    def gradient_piece(self, in_file):
        """Elements of the host piece a gradient on the device goes down through (C++ Note [gradient on
        the device]): the nvme tier's chunk as its store rounds it (in_file), else the 'cpu' tier's
        chunk_numel."""
        return self.aligned(self.chunk_numel) if in_file else self.chunk_numel

    def replace_fraction(self, ram_fraction):
        return dataclasses.replace(self, ram_fraction=ram_fraction)

    def fraction_for(self, state_numel, ram_records):
        """The ram_fraction that keeps ram_records records in RAM (floor() of it gives exactly that)."""
        chunks = self.chunks(state_numel)
        return 0.0 if ram_records <= 0 or chunks == 0 else min(1.0, (min(ram_records, chunks) + 0.5) / chunks)

    def file_bytes(self, state_numel, state_bytes):
        records = (self.chunks(state_numel) - self.ram_chunks(state_numel)) * self.record_bytes(state_bytes)
        return records + (self.aligned(4 * state_numel) if self.gradients else 0)

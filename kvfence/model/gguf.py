"""Reading GGUF files: gguf's reader, made fast on large vocabularies, over a whole file or
every part of a model split by llama-gguf-split."""

import mmap
import re
import struct
import sys
from pathlib import Path

import numpy as np

from kvfence.model.config import ModelLoadError

SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")  # llama.cpp's llama_split_path


def open_gguf(path: Path):
    """The file's GGUFReader, which memory-maps it (for the first part of a split model, with
    the other parts' tensors added), or a ModelLoadError saying why not."""
    from gguf import GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        """gguf-py 0.19's reader, with arrays of scalars or strings read in one pass over a plain
        view of the file: the stock one makes two memory-mapped views of each element, seconds
        and hundreds of MiB for a 128k-token vocabulary. Fields come out the same."""

        def _get_field_parts(self, offset: int, raw_type: int):
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(offset, raw_type)
            item_type, count = self._get(offset, np.uint32), self._get(offset + 4, np.uint64)
            kind = GGUFValueType(item_type[0])
            data = self.data.view(np.ndarray)  # slicing a memmap costs microseconds a slice
            at = offset + 12
            if kind == GGUFValueType.STRING:
                little = (self.byte_order == "I") == (sys.byteorder == "little")
                items = []
                for _ in range(int(count[0])):
                    (length,) = struct.unpack_from("<Q" if little else ">Q", data, at)
                    items.append(data[at + 8 : at + 8 + length])
                    at += 8 + length
            elif kind in self.gguf_scalar_to_np:
                values = self._get(at, self.gguf_scalar_to_np[kind], count[0]).view(np.ndarray)
                items = [values[i : i + 1] for i in range(len(values))]
                at += values.nbytes
            else:  # arrays of arrays
                return super()._get_field_parts(offset, raw_type)
            if at > len(data) or len(items) != count[0]:
                raise ValueError(
                    f"an array of {count[0]} {kind.name} runs past the end of the file"
                )
            indices = list(range(2, 2 + len(items)))
            return at - offset, [item_type, count, *items], indices, [GGUFValueType.ARRAY, kind]

    def read(path: Path) -> Reader:
        try:
            reader = Reader(str(path))
        except Exception as e:  # the gguf package raises bare ValueError/struct errors
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        # the mapping each tensor's data_offset counts in (drop_mapped_pages)
        reader.mappings = {t.name: reader.data._mmap for t in reader.tensors}
        return reader

    reader = read(path)
    parts = _split_parts(path, reader)
    for number, part in enumerate(parts[1:], 1):  # the first part holds the metadata
        if not part.is_file():
            raise ModelLoadError(
                f"{part.name}, part {number + 1} of {path.name}'s model, is missing"
            )
        more = read(part)
        if _split(more) != (number, len(parts)):
            no, count = _split(more)
            raise ModelLoadError(
                f"{part.name} has split.no = {no}, split.count = {count}: it is not part "
                f"{number + 1} of {len(parts)} of {path.name}'s model"
            )
        if again := sorted(set(more.mappings) & set(reader.mappings)):
            raise ModelLoadError(f"{part.name} holds {again[0]} again, as an earlier part does")
        reader.tensors.extend(more.tensors)
        reader.mappings |= more.mappings
    return reader


def _split(reader) -> tuple[int, int]:
    """(split.no, split.count) of a part of a GGUF model split by llama-gguf-split; (0, 1)
    for a whole file."""
    fields = reader.fields
    if "split.count" not in fields:
        return 0, 1
    return int(fields["split.no"].contents()), int(fields["split.count"].contents())


def _split_parts(path: Path, reader) -> list[Path]:
    """The files of a split GGUF model, named as llama.cpp's llama_split_path names them
    (`PREFIX-00001-of-00003.gguf`), from its first part; [path] for a whole file."""
    number, count = _split(reader)
    if count == 1:
        return [path]
    named = SPLIT_NAME.fullmatch(path.name)
    if named is None or int(named[3]) != count:
        raise ModelLoadError(
            f"{path.name} is part {number + 1} of a GGUF model split into {count} files "
            f"(split.count = {count}), not named PREFIX-{number + 1:05d}-of-{count:05d}.gguf as "
            "llama-gguf-split names them: the other parts cannot be found"
        )
    if number != 0:
        first = f"{named[1]}-00001-of-{count:05d}.gguf"
        raise ModelLoadError(
            f"{path.name} is part {number + 1} of {count} of a split GGUF model: give its "
            f"first part, {first}, which holds the model's metadata"
        )
    return [path.with_name(f"{named[1]}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def drop_mapped_pages(reader, tensor) -> None:
    """Takes a tensor's pages of the memory-mapped file out of this process once it is copied
    (the kernel keeps them in the page cache): every page read would otherwise stay resident
    to the end of the load, the whole file beside the weights made from it."""
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    reader.mappings[tensor.name].madvise(
        mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start
    )

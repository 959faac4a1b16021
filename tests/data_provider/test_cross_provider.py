"""The same batch ids through the local, HTTP and TCP providers over the same files give the
same tokens (and data.toml is read as upstream reads it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.identity import SecretKey
from psyche.core.token_size import TokenSize
from psyche.data_provider import (
    DataConfigError,
    DataProviderTcpClient,
    DataProviderTcpServer,
    DataServerInfo,
    FileURLs,
    HttpConfig,
    HttpDataProvider,
)
from psyche.data_provider.local import list_data_files

pytestmark = pytest.mark.anyio
SEED = bytes(range(100, 132))
SEQ = 32


async def test_local_http_and_tcp_agree(http_root: Path, http_server, write_tokens) -> None:
    gen = np.random.default_rng(5)
    data = http_root / "data"
    # Sizes where upstream's local bound and its HTTP bound (one token reserved) give the same
    # number of sequences: whole sequences, or three tokens more.
    for name, tokens in (("c.ds", 7 * SEQ), ("a.ds", 4 * SEQ + 3), ("b.bin", 11 * SEQ)):
        write_tokens(data / name, gen.integers(0, 2**32, tokens, dtype=np.uint64), nbytes=4)
    config = http_root / "data.toml"
    config.write_text(
        f'dir = "data"\ntoken_size = "FourBytes"\nseq_len = {SEQ}\nshuffle_seed = {list(SEED)}\n'
    )

    info = DataServerInfo.load(config)
    assert Path(info.dir) == data
    assert info.token_size is TokenSize.FourBytes
    local = info.open_provider()
    n = local.num_sequences()
    assert n == 6 + 4 + 10
    # Serve the files over HTTP in the order the local provider lists them.
    urls = [f"{http_server.url}/data/{p.name}" for p in list_data_files(data)]
    cfg = HttpConfig()
    http = await HttpDataProvider.open(
        lambda c: FileURLs.from_list(c, urls, cfg),
        TokenSize.FourBytes,
        SEQ,
        Shuffle.Seeded(SEED),
        cfg,
    )
    key = SecretKey.generate()
    async with DataProviderTcpServer.start(
        local, host="127.0.0.1", allowed=[key.public_key]
    ) as server:
        tcp = await DataProviderTcpClient.connect(f"127.0.0.1:{server.local_addr[1]}", key)
        try:
            assert http.num_sequences() == n
            for batch in (BatchId(0, n - 1), BatchId(3, 3), BatchId(7, 12)):
                from_local = await local.get_samples(batch)
                assert await http.get_samples(batch) == from_local
                assert await tcp.get_samples(batch) == from_local
            everything = await local.get_samples(BatchId(0, n - 1))
            assert min(int(s.input_ids.min()) for s in everything) < 0  # u32 tokens wrapped to i32
        finally:
            await tcp.aclose()
            await http.aclose()
            local.close()


def test_data_toml_errors_name_the_file_and_field(tmp_path: Path) -> None:
    config = tmp_path / "data.toml"
    config.write_text('dir = "x"\ntoken_size = "TwoBytes"\nseq_len = -3\nshuffle_seed = [1, 2]\n')
    with pytest.raises(DataConfigError) as err:
        DataServerInfo.load(config)
    text = str(err.value)
    assert str(config) in text
    assert "seq_len" in text
    assert "shuffle_seed" in text
    config.write_text("dir = \n")
    with pytest.raises(DataConfigError, match="not valid TOML"):
        DataServerInfo.load(config)
    with pytest.raises(DataConfigError, match="cannot read"):
        DataServerInfo.load(tmp_path / "missing.toml")
    absolute = tmp_path / "abs.toml"
    absolute.write_text(
        f'dir = "{tmp_path}"\ntoken_size = "TwoBytes"\nseq_len = 4\nshuffle_seed = {[0] * 32}\n'
    )
    assert DataServerInfo.load(absolute).dir == str(tmp_path)

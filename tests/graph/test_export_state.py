"""A model that writes a buffer during its forward (a cache object, a recurrent state kept in the
module) is refused at export: that state would carry over from one engine step to the next."""

from types import SimpleNamespace

import pytest
import torch

from autodeploy.errors import ExportError
from autodeploy.export import export_model


def _accumulate(state, hidden):
    state.add_(hidden.sum(dim=(0, 1)))


def _keep_last_token_in_a_view(state, hidden):
    state[:2].copy_(hidden[0, -1, :2])


def _count_calls(state, hidden):
    state += 1  # no token involved: only the state check sees it


class RunningState(torch.nn.Module):
    """An HF-shaped causal LM whose ``mixer.state`` is written by ``update`` on every call."""

    def __init__(self, update):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.mixer = torch.nn.Module()
        self.mixer.register_buffer("state", torch.zeros(4))
        self.update = update

    def forward(self, input_ids, position_ids, use_cache):
        hidden = self.embed(input_ids)
        self.update(self.mixer.state, hidden)
        return SimpleNamespace(logits=hidden + self.mixer.state)


@pytest.mark.parametrize("update", [_accumulate, _keep_last_token_in_a_view, _count_calls])
def test_a_buffer_written_during_the_forward_is_refused_naming_it(update):
    with torch.device("meta"):
        model = RunningState(update)
    with pytest.raises(ExportError, match=r"RunningState writes to mixer\.state during its forward: state carried"):
        export_model(model)

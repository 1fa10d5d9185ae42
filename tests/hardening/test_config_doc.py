"""help(MoEConfig) documents every field: the class docstring's Attributes section names each
dataclass field, once, in the fields' order, with a description."""
import dataclasses
import pydoc
import re

from moe_core import MoEConfig

_ENTRY = re.compile(r"^        (\w+): (\S.*)$", re.M)


def test_every_field_is_documented_in_order():
    entries = _ENTRY.findall(MoEConfig.__doc__)
    fields = [f.name for f in dataclasses.fields(MoEConfig)]
    documented = [name for name, _ in entries]
    assert sorted(set(fields) - set(documented)) == [], "fields without a line in the docstring"
    assert sorted(set(documented) - set(fields)) == [], "docstring entries that are no field"
    assert documented == fields, "the Attributes section follows the fields' order"
    assert all(len(text) > 10 for _, text in entries)


def test_help_shows_the_attributes():
    text = pydoc.render_doc(MoEConfig, renderer=pydoc.plaintext)
    assert "Attributes:" in text
    assert "moe_router_topk: experts per token k." in text

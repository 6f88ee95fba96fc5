"""Print the variable table of docs/telemetry.md from ``workbench.telemetry.schema.SCHEMA``.

    python docs/gen_telemetry_table.py            # paste the output into docs/telemetry.md
"""

from __future__ import annotations

from workbench.telemetry.schema import GROWING, SCHEMA


def table() -> str:
    rows = ["| variable | dims | dtype | chunk | units | description |",
            "|---|---|---|---|---|---|"]
    for name, v in SCHEMA.items():
        dims = ", ".join(f"**{d}**" if d in GROWING else d for d in v.dims)
        doc = v.doc.replace("|", "\\|")
        rows.append(f"| `{name}` | ({dims}) | {v.dtype} | {v.chunk} | {v.units} | {doc} |")
    rows.append("| `pinned` | (layer) | bool | – | flag | layer belongs to the pinned (always "
                "resident) prefix; written once, does not grow |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())

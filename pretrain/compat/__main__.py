"""`python -m pretrain.compat`: print the table of every megatron-core workaround."""

from pretrain.compat import MEGATRON_CORE_VERSION, WORKAROUNDS, applies


def main() -> None:
    print(f"pretrain.compat: {len(WORKAROUNDS)} workarounds for megatron-core {MEGATRON_CORE_VERSION}\n")
    for w in WORKAROUNDS:
        how = f"install() applies it ({w.when}{'' if applies(w.when) else ', not on this host'})" if w.install else "used at its call site"
        print(f"{w.name}\n  target:   {w.target}\n  reason:   {w.reason}\n  upstream: {w.upstream}\n"
              f"  test:     {w.test}\n  how:      {how}\n")


if __name__ == "__main__":
    main()

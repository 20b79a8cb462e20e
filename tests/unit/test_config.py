

def test_the_run_sections_a_checkpoint_check_knows_are_configs():
    """preflight cannot import config (a floor above it): its list of the run config's sections
    is written there, and must stay the Config tree's."""
    import dataclasses

    from dflash.config import Config
    from dflash.preflight.checkpoint_files import RUN_SECTIONS

    assert set(RUN_SECTIONS) == {f.name for f in dataclasses.fields(Config)
                                 if dataclasses.is_dataclass(getattr(Config(), f.name))}

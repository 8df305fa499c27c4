"""`launch.my_policy:PlateauLR`, kept for the repository's tests and old configs: the template ships in the
package as `pdv_ext/examples/my_policy.py` (name it `pdv_ext.examples.my_policy:PlateauLR` in a config, or
copy it out with `pdv example plugins DIR`)."""
from pdv_ext.examples.my_policy import PlateauLR

__all__ = ["PlateauLR"]

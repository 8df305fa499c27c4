"""The repository's entry to the Horovod example; the script ships in the package as
`pdv_ext/examples/train_horovod.py` (`python -m pdv_ext.examples.train_horovod`).

    horovodrun -np 4 -H localhost:4 --gloo python launch/train_horovod.py --config launch/configs/horovod.yaml
"""
import sys

from pdv_ext.examples.train_horovod import main

if __name__ == "__main__":
    sys.exit(main())

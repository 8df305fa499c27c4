"""The repository's entry to the main job; the script itself ships in the package as
`pdv_ext/examples/train_gpt.py` (`python -m pdv_ext.examples.train_gpt`, or `pdv example train_gpt DIR`).

    deepspeed --num_gpus 4 launch/train_gpt.py --deepspeed_config launch/configs/demo.json --out runs/demo

`make demo` (launch/demo.sh) and the GPU tier run it from here; `launch/configs`, `launch/clusters` and
`launch/scenarios` are links to the shipped `pdv_ext/examples/` folders.
"""
from pdv_ext.examples.train_gpt import main

if __name__ == "__main__":
    main()

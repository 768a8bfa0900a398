import sys

from hvdtrain.launch.runner import main

sys.exit(main())

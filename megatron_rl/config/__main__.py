from megatron_rl.config.describe import main

main()
